#!/bin/sh
# A stand-in for ssh in multiproc tests (pipesgd run --ssh-program): takes ssh's options, then
# runs the remote command on this machine with sh, as sshd would with the user's shell.
# Hosts named bad* fail as an unknown host does (exit 255, ssh's message).
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-i|-F|-l) shift 2 ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
case "$host" in
  bad*) echo "ssh: Could not resolve hostname $host: Name or service not known" >&2; exit 255 ;;
esac
export SSH_CONNECTION="127.0.0.1 40000 127.0.0.1 22"
exec sh -c "$*"

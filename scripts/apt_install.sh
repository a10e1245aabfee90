#!/usr/bin/env bash
# Installs the Debian packages named after WHO (a name for messages) that are not installed yet;
# the one place this project runs apt, for install_deps.sh, arm64_deps.sh, rdma_vm --install and
# the benches that need PyTorch.
#   scripts/apt_install.sh WHO PACKAGE...
# - Idempotent: nothing runs, not even `apt-get update`, when every package is there.
# - Installs queue on /tmp/pipesgd-apt.lock (CI installs two sets at once), and wait up to 10 min
#   for dpkg's own lock (unattended-upgrades, an apt someone else started) instead of failing.
# - An apt run that was interrupted (killed, or the machine stopped mid-install) leaves dpkg
#   half-configured, and every later apt-get refuses with "dpkg was interrupted". A machine
#   snapshotted in that state is what CI once started from; finishing the pending configuration
#   first (`dpkg --configure -a`, then `apt-get -f install`) is what apt's message asks for.
# Needs root (or sudo). INITRD, when set, is passed to apt (rdma_vm: INITRD=No).
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: scripts/apt_install.sh WHO PACKAGE..." >&2; exit 2; }
who=$1
shift
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

missing=()
for p in "$@"; do
  installed "$p" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "$who: all $# packages already installed"
  exit 0
fi

apt_env=(env DEBIAN_FRONTEND=noninteractive ${INITRD:+INITRD=$INITRD})
apt=("${apt_env[@]}" apt-get -o DPkg::Lock::Timeout=600 -y -qq --no-install-recommends)

# One lock around the repair, the update and the install: a second script's apt between them
# would find dpkg mid-configure again.
# (Opened for reading: flock needs no write access, and the file may be another user's.)
lock=/tmp/pipesgd-apt.lock
if [[ ! -e $lock ]]; then
  { : >> "$lock" && chmod a+r "$lock"; } 2>/dev/null || true
fi
if { exec 9< "$lock"; } 2>/dev/null; then
  flock 9
else
  echo "$who: cannot open $lock to queue behind other installs; going on without it" >&2
fi

# What apt itself checks ("dpkg was interrupted": a journal left in updates/), and packages that
# dpkg --audit finds unpacked, half-installed or awaiting triggers. Its stderr (warnings) is not
# a broken package.
interrupted() {
  [[ -n "$(ls -A /var/lib/dpkg/updates 2>/dev/null)" || -n "$(dpkg --audit 2>/dev/null)" ]]
}
updated=0
if interrupted; then
  pending=$(dpkg --audit 2>/dev/null || true)
  echo "$who: dpkg was left mid-install by an interrupted apt run; finishing it first" \
    "(dpkg --configure -a):"
  # head first: under pipefail, sed killed by SIGPIPE on a long list would end the script.
  head -n 20 <<< "${pending:-(a journal left in /var/lib/dpkg/updates)}" | sed 's/^/  /'
  # dpkg has no lock timeout of its own: wait for the lock through apt's (a no-op install,
  # which then refuses as it would).
  $SUDO "${apt[@]}" install >/dev/null 2>&1 || true
  # --configure -a fails where a package waits for a dependency that was never unpacked; the
  # update and `-f install` then fetch it.
  $SUDO "${apt_env[@]}" dpkg --configure -a || true
  $SUDO "${apt[@]}" update
  $SUDO "${apt[@]}" -f install
  updated=1
  if interrupted; then
    echo "$who: dpkg still reports broken packages after dpkg --configure -a and" \
      "apt-get -f install:" >&2
    dpkg --audit >&2 || true
    exit 1
  fi
fi

echo "$who: installing ${missing[*]}"
[[ $updated == 1 ]] || $SUDO "${apt[@]}" update
$SUDO "${apt[@]}" install "${missing[@]}"

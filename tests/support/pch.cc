// The program tests/CMakeLists.txt compiles the tests' precompiled header with (it is never run).
int main() { return 0; }

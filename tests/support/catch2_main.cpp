// main() of the plain Catch2 test programs.
#include "catch2_runner.h"

int main(int argc, char** argv) { return test_support::run_catch2(argc, argv); }

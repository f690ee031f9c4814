// main() of every test binary (mg_test_main): Catch2's runner.
#include "support/main.h"

int main(int argc, char* argv[]) { return mgtest::run_catch(argc, argv); }

// Small pieces every room that starts a program needs: finding it on PATH like execvp,
// quoting words for a POSIX shell (ssh remote commands, batch scripts) and turning a
// wait() status into a shell-style exit code. Pure apart from stat()/access().
#pragma once

#include <string>

namespace mg {

// Finds `name` like execvp would (a name with '/' is taken as a path). Empty if not found
// or not executable.
std::string find_executable(const std::string& name, const std::string& path_env);

// POSIX shell quoting: the word as is when it is plainly safe, else in single quotes
// (embedded quotes escaped).
std::string shell_quote(const std::string& word);

// Maps a raw wait() status to a shell-style exit code: N for exit(N), 128+S for signal S.
int shell_exit_code(int wait_status);

}  // namespace mg

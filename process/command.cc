#include "process/command.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string_view>

#include "cli/errors.h"

namespace mg {

std::string find_executable(const std::string& name, const std::string& path_env) {
  auto usable = [](const std::string& p) {
    struct stat st{};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (!usable(name)) return {};
    if (name.front() == '/') return name;
    char cwd[4096];
    return ::getcwd(cwd, sizeof(cwd)) ? std::string(cwd) + "/" + name : name;
  }
  std::size_t pos = 0;
  while (pos <= path_env.size()) {
    auto colon = path_env.find(':', pos);
    std::string dir = path_env.substr(pos, colon == std::string::npos ? std::string::npos : colon - pos);
    if (dir.empty()) dir = ".";
    if (std::string candidate = dir + "/" + name; usable(candidate)) return find_executable(candidate, {});
    if (colon == std::string::npos) break;
    pos = colon + 1;
  }
  return {};
}

std::string shell_quote(const std::string& word) {
  constexpr std::string_view kSafe = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,@+%";
  if (!word.empty() && word.find_first_not_of(kSafe) == std::string::npos) return word;
  std::string out = "'";
  for (char c : word) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

int shell_exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return exit_code::kSignalBase + WTERMSIG(status);
  return exit_code::kInternal;
}

}  // namespace mg

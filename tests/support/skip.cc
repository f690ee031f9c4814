#include "support/skip.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <iostream>

namespace mgtest {

namespace {

std::atomic<int> g_failed_checks{0};

bool listed_missing(const std::string& name) {
  const char* env = std::getenv("MGTEST_MISSING");
  if (!env) return false;
  std::stringstream list(env);
  for (std::string item; std::getline(list, item, ',');)
    if (!item.empty() && item == name) return true;
  return false;
}

std::string basename_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string find_program(const std::string& name_or_path) {
  if (listed_missing(basename_of(name_or_path))) return {};
  if (name_or_path.find('/') != std::string::npos)
    return ::access(name_or_path.c_str(), X_OK) == 0 ? name_or_path : std::string();
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (dir.empty()) continue;
    const std::string candidate = dir + "/" + name_or_path;
    if (::access(candidate.c_str(), X_OK) == 0 && !std::filesystem::is_directory(candidate)) return candidate;
  }
  return {};
}

}  // namespace

void detail::note_failed_check() { ++g_failed_checks; }

[[noreturn]] void skip_test(const std::string& reason) {
  if (const int failed = g_failed_checks.load(); failed > 0) {
    std::cout << "error: " << failed << " check(s) failed before this test skipped (" << reason << ")" << std::endl;
    std::exit(1);
  }
  std::cout << "skipped: " << reason << std::endl;
  std::exit(77);
}

bool in_ci() {
  const char* ci = std::getenv("CI");
  if (!ci) return false;
  const std::string v = ci;
  return v == "true" || v == "TRUE" || v == "True" || v == "1" || v == "yes";
}

void require_installed(bool present, const std::string& what, const std::string& debian_package) {
  if (present) return;
  if (in_ci()) {
    std::cout << "error: " << what << " is missing and CI=true: install Debian package " << debian_package
              << " (make setup installs it; under CI a missing component fails, it does not skip)" << std::endl;
    std::exit(1);
  }
  skip_test(what + " is missing (make setup installs Debian package " + debian_package + ")");
}

std::string require_program(const std::string& name_or_path, const std::string& debian_package) {
  std::string found = find_program(name_or_path);
  require_installed(!found.empty(), name_or_path, debian_package);
  return found;
}

void require_path(const std::string& path, const std::string& debian_package) {
  std::error_code ec;
  require_installed(!listed_missing(basename_of(path)) && std::filesystem::exists(path, ec), path, debian_package);
}

void require_in_ci(bool present, const std::string& reason) {
  if (present) return;
  if (in_ci()) {
    std::cout << "error: " << reason << " (CI=true: this must work under CI, it does not skip)" << std::endl;
    std::exit(1);
  }
  skip_test(reason);
}

}  // namespace mgtest

#include "process/proc.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <string>
#include <unordered_map>

#include <fmt/format.h>

namespace mg {

std::optional<ProcStat> parse_proc_stat(std::string_view text) {
  // "pid (comm) S ppid pgrp ...": comm is everything up to the LAST ')'.
  const auto open = text.find('(');
  const auto close = text.rfind(')');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open) return std::nullopt;
  auto number = [](std::string_view& t, long& out) {
    while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
    bool neg = !t.empty() && t.front() == '-';
    if (neg) t.remove_prefix(1);
    if (t.empty() || t.front() < '0' || t.front() > '9') return false;
    out = 0;
    while (!t.empty() && t.front() >= '0' && t.front() <= '9') {
      out = out * 10 + (t.front() - '0');
      if (out > (1L << 31)) return false;
      t.remove_prefix(1);
    }
    if (neg) out = -out;
    return true;
  };
  ProcStat st;
  long v = 0;
  std::string_view head = text.substr(0, open);
  if (!number(head, v) || v <= 0) return std::nullopt;
  st.pid = static_cast<pid_t>(v);
  std::string_view rest = text.substr(close + 1);
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  if (rest.empty()) return std::nullopt;
  st.state = rest.front();
  rest.remove_prefix(1);
  if (!number(rest, v)) return std::nullopt;
  st.ppid = static_cast<pid_t>(v);
  if (!number(rest, v)) return std::nullopt;
  st.pgrp = static_cast<pid_t>(v);
  return st;
}

std::vector<ProcStat> scan_processes() {
  std::vector<ProcStat> out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  std::string path, text;
  char buf[1024];
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    path = fmt::format("/proc/{}/stat", e->d_name);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // gone meanwhile
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    ::close(fd);
    if (n <= 0) continue;
    if (auto st = parse_proc_stat(std::string_view(buf, static_cast<std::size_t>(n)))) out.push_back(*st);
  }
  ::closedir(d);
  return out;
}

std::vector<ProcStat> scan_family(pid_t root) {
  static const bool have_children = [] {
    const std::string self = fmt::format("/proc/{0}/task/{0}/children", ::getpid());
    return ::access(self.c_str(), R_OK) == 0;
  }();
  if (!have_children) return scan_processes();
  std::vector<ProcStat> out;
  std::vector<pid_t> frontier{root};
  std::unordered_set<pid_t> seen{root};  // each pid once: bounded by the tree
  char buf[4096];
  std::string list;
  while (!frontier.empty()) {
    std::vector<pid_t> next;
    for (pid_t pid : frontier) {
      // Every thread: an orphan re-parented to a subreaper goes to one of its threads.
      DIR* tasks = ::opendir(fmt::format("/proc/{}/task", pid).c_str());
      if (!tasks) continue;  // gone meanwhile
      while (dirent* t = ::readdir(tasks)) {
        if (t->d_name[0] < '1' || t->d_name[0] > '9') continue;
        const int fd = ::open(fmt::format("/proc/{}/task/{}/children", pid, t->d_name).c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        list.clear();
        for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) list.append(buf, static_cast<std::size_t>(n));
        ::close(fd);
        for (std::size_t i = 0; i < list.size();) {
          pid_t child = 0;
          for (; i < list.size() && list[i] >= '0' && list[i] <= '9'; ++i) child = child * 10 + (list[i] - '0');
          for (; i < list.size() && (list[i] < '0' || list[i] > '9'); ++i) {
          }
          if (child <= 0 || !seen.insert(child).second) continue;
          const int sfd = ::open(fmt::format("/proc/{}/stat", child).c_str(), O_RDONLY | O_CLOEXEC);
          if (sfd < 0) continue;
          const ssize_t n = ::read(sfd, buf, sizeof(buf));
          ::close(sfd);
          if (n <= 0) continue;
          if (auto st = parse_proc_stat(std::string_view(buf, static_cast<std::size_t>(n)))) {
            out.push_back(*st);
            next.push_back(child);
          }
        }
      }
      ::closedir(tasks);
    }
    frontier = std::move(next);
  }
  return out;
}

std::vector<ProcStat> descendants_of(const std::vector<ProcStat>& table, pid_t root) {
  std::unordered_map<pid_t, std::vector<std::size_t>> children;
  children.reserve(table.size());
  for (std::size_t i = 0; i < table.size(); ++i)
    if (table[i].pid != root) children[table[i].ppid].push_back(i);
  std::vector<ProcStat> out;
  std::vector<pid_t> stack{root};
  std::unordered_set<pid_t> seen{root};  // a malformed table (a cycle) must not loop
  while (!stack.empty()) {
    const pid_t p = stack.back();
    stack.pop_back();
    auto it = children.find(p);
    if (it == children.end()) continue;
    for (std::size_t i : it->second) {
      if (!seen.insert(table[i].pid).second) continue;
      stack.push_back(table[i].pid);
      if (table[i].state != 'Z') out.push_back(table[i]);
    }
  }
  return out;
}

std::unordered_set<pid_t> descendant_groups(const std::vector<ProcStat>& table, pid_t root) {
  std::unordered_set<pid_t> out;
  for (const auto& p : descendants_of(table, root)) out.insert(p.pgrp);
  return out;
}

}  // namespace mg

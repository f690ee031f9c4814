#include "process/proc.h"
#include "process/listeners.h"
#include "process/fd.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>

#include <fmt/format.h>

namespace mg {

namespace {

// The next blank-separated field of `t` as a number; a leading '-' is read as 0 (tty_nr,
// a pgrp of -1 in a pid namespace) and flagged in `neg`.
bool next_number(std::string_view& t, std::uint64_t& out, bool& neg) {
  while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
  neg = !t.empty() && t.front() == '-';
  if (neg) t.remove_prefix(1);
  const auto end = t.find(' ');
  const std::string_view field = t.substr(0, end);
  auto [p, ec] = std::from_chars(field.data(), field.data() + field.size(), out);
  if (field.empty() || ec != std::errc{} || p != field.data() + field.size()) return false;
  t.remove_prefix(field.size());
  return true;
}

}  // namespace

int signal_same_process(long pid, unsigned long long starttime, int sig, bool use_pidfd) {
  if (pid <= 0) return 0;
  int pidfd = -1;
  if (use_pidfd) {
    pidfd = open_pidfd(static_cast<pid_t>(pid));
    if (pidfd < 0 && errno != ENOSYS) return errno == ESRCH ? 0 : -1;
  }
  // The pidfd (when there is one) was opened first: if the start time still matches now,
  // it refers to that process, and a signal through it cannot reach a later one.
  const auto st = read_proc_stat(static_cast<pid_t>(pid));
  if (!st || st->starttime != starttime || st->state == 'Z') {
    if (pidfd >= 0) ::close(pidfd);
    return 0;
  }
#ifdef SYS_pidfd_send_signal
  if (pidfd >= 0) {
    const long r = ::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0U);
    const int e = errno;
    ::close(pidfd);
    if (r == 0) return 1;
    if (e != ENOSYS) return e == ESRCH ? 0 : -1;
  }
#else
  if (pidfd >= 0) ::close(pidfd);
#endif
  return ::kill(static_cast<pid_t>(pid), sig) == 0 ? 1 : (errno == ESRCH ? 0 : -1);
}

std::optional<ProcessGroup> ProcessGroup::open(long pid, unsigned long long starttime) {
  if (pid <= 1) return std::nullopt;
  Fd pidfd(open_pidfd(static_cast<pid_t>(pid)));
  if (!pidfd && errno != ENOSYS) return std::nullopt;  // gone (ESRCH), or no descriptor left
  // Read after the pidfd was taken: when it matches now, the pidfd is that process's.
  const auto st = read_proc_stat(static_cast<pid_t>(pid));
  if (!st || st->starttime != starttime || st->state == 'Z' || st->pgrp != pid) return std::nullopt;
  return ProcessGroup(std::move(pidfd), static_cast<pid_t>(pid));
}

int ProcessGroup::signal(int sig) const {
#ifdef SYS_pidfd_send_signal
  constexpr unsigned kProcessGroup = 1U << 2;  // PIDFD_SIGNAL_PROCESS_GROUP (linux/pidfd.h, Linux 6.9)
  if (pidfd_ && use_pidfd_) {
    if (::syscall(SYS_pidfd_send_signal, pidfd_.get(), sig, nullptr, kProcessGroup) == 0) return 1;
    if (errno != EINVAL && errno != ENOSYS) return errno == ESRCH ? 0 : -1;  // EINVAL: a kernel without the flag
  }
#endif
  return ::kill(-pid_, sig) == 0 ? 1 : (errno == ESRCH ? 0 : -1);
}

bool pidfd_available() {
  static const bool available = [] {
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_send_signal)
    const int fd = static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0));
    if (fd < 0) return errno != ENOSYS;  // (EMFILE now says nothing of the kernel)
    const bool sends = ::syscall(SYS_pidfd_send_signal, fd, 0, nullptr, 0U) == 0 || errno != ENOSYS;
    ::close(fd);
    return sends;
#else
    return false;
#endif
  }();
  return available;
}

std::optional<ProcStat> parse_proc_stat(std::string_view text) {
  const auto open = text.find('(');
  const auto close = text.rfind(')');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open) return std::nullopt;
  std::uint64_t v = 0;
  bool neg = false;
  std::string_view head = text.substr(0, open);
  while (!head.empty() && head.back() == ' ') head.remove_suffix(1);
  if (!next_number(head, v, neg) || neg || v == 0 || v > (1U << 30) || !head.empty()) return std::nullopt;
  ProcStat st;
  st.pid = static_cast<pid_t>(v);
  std::string_view rest = text.substr(close + 1);
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  if (rest.empty()) return std::nullopt;
  st.state = rest.front();
  rest.remove_prefix(1);
  std::uint64_t f[23] = {};
  for (int i = 4; i <= 22; ++i) {
    if (!next_number(rest, f[i], neg)) return std::nullopt;
    if (neg) f[i] = (i == 4 || i == 5) ? static_cast<std::uint64_t>(-1) : 0;
  }
  st.ppid = f[4] == static_cast<std::uint64_t>(-1) ? -1 : static_cast<pid_t>(f[4]);
  st.pgrp = f[5] == static_cast<std::uint64_t>(-1) ? -1 : static_cast<pid_t>(f[5]);
  st.flags = f[9];
  st.cpu_ticks = f[14] + f[15];
  st.starttime = f[22];
  return st;
}

std::optional<std::string_view> proc_status_field(std::string_view status, std::string_view name) {
  for (std::size_t at = 0; at < status.size();) {
    const auto nl = status.find('\n', at);
    std::string_view line = status.substr(at, nl == std::string_view::npos ? std::string_view::npos : nl - at);
    at = nl == std::string_view::npos ? status.size() : nl + 1;
    if (line.size() <= name.size() || !line.starts_with(name) || line[name.size()] != ':') continue;
    line.remove_prefix(name.size() + 1);
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    while (!line.empty() && (line.back() == ' ' || line.back() == '\t')) line.remove_suffix(1);
    return line;
  }
  return std::nullopt;
}

std::optional<std::uint64_t> proc_status_bytes(std::string_view status, std::string_view name) {
  const auto value = proc_status_field(status, name);
  if (!value) return std::nullopt;
  std::uint64_t kb = 0;
  auto [p, ec] = std::from_chars(value->data(), value->data() + value->size(), kb);
  if (ec != std::errc{} || p == value->data()) return std::nullopt;
  std::string_view unit = value->substr(static_cast<std::size_t>(p - value->data()));
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  if (unit != "kB") return std::nullopt;
  return kb * 1024;
}

std::string read_proc_file(pid_t pid, std::string_view leaf, std::size_t max, std::string_view proc_root) {
  const std::string path = pid > 0 ? fmt::format("{}/{}/{}", proc_root, pid, leaf) : fmt::format("{}/self/{}", proc_root, leaf);
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[4096];
  while (out.size() < max) {
    const ssize_t n = ::read(fd, buf, std::min(sizeof(buf), max - out.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

std::optional<ProcStat> read_proc_stat(pid_t pid, std::string_view proc_root) {
  return parse_proc_stat(read_proc_file(pid, "stat", 4096, proc_root));
}

std::vector<pid_t> read_proc_children(pid_t pid, pid_t tid) {
  std::vector<pid_t> out;
  const std::string list = read_proc_file(pid, fmt::format("task/{}/children", tid), std::size_t{1} << 22);
  std::string_view t = list;
  std::uint64_t v = 0;
  bool neg = false;
  while (next_number(t, v, neg))
    if (!neg && v > 0) out.push_back(static_cast<pid_t>(v));
  return out;
}

std::string read_proc_environ(pid_t pid, std::size_t max) { return read_proc_file(pid, "environ", max); }

std::optional<std::pair<int, int>> parse_port_range_text(std::string_view text) {
  std::uint64_t lo = 0, hi = 0;
  bool neg = false;
  std::string flat(text);
  for (char& c : flat)
    if (c == '\t' || c == '\n') c = ' ';
  std::string_view t = flat;
  if (!next_number(t, lo, neg) || neg || !next_number(t, hi, neg) || neg) return std::nullopt;
  while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
  if (!t.empty() || lo < 1 || hi > 65535 || lo > hi) return std::nullopt;
  return std::pair<int, int>{static_cast<int>(lo), static_cast<int>(hi)};
}

std::optional<std::pair<int, int>> ephemeral_port_range_of_kernel() {
  const int fd = ::open("/proc/sys/net/ipv4/ip_local_port_range", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[64];
  const ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  if (n <= 0) return std::nullopt;
  return parse_port_range_text(std::string_view(buf, static_cast<std::size_t>(n)));
}

std::vector<ProcStat> scan_processes(std::string_view proc_root) {
  std::vector<ProcStat> out;
  DIR* d = ::opendir(std::string(proc_root).c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    pid_t pid = 0;
    if (std::from_chars(e->d_name, e->d_name + std::strlen(e->d_name), pid).ec != std::errc{}) continue;
    if (auto st = read_proc_stat(pid, proc_root)) out.push_back(*st);  // nothing when gone meanwhile
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
  while (!frontier.empty()) {
    std::vector<pid_t> next;
    for (pid_t pid : frontier) {
      // Every thread: an orphan re-parented to a subreaper goes to one of its threads.
      DIR* tasks = ::opendir(fmt::format("/proc/{}/task", pid).c_str());
      if (!tasks) continue;  // gone meanwhile
      while (dirent* t = ::readdir(tasks)) {
        if (t->d_name[0] < '1' || t->d_name[0] > '9') continue;
        for (pid_t child : read_proc_children(pid, static_cast<pid_t>(std::atol(t->d_name)))) {
          if (!seen.insert(child).second) continue;
          if (auto st = read_proc_stat(child)) {
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

std::vector<TcpListener> parse_tcp_listeners(std::string_view text, int port) {
  // "  sl  local_address rem_address   st tx_queue:rx_queue tr:tm->when retrnsmt   uid  timeout inode"
  std::vector<TcpListener> out;
  std::size_t pos = text.find('\n');  // the header
  while (pos != std::string_view::npos && pos + 1 < text.size()) {
    const std::size_t end = text.find('\n', pos + 1);
    const std::string_view line = text.substr(pos + 1, end == std::string_view::npos ? end : end - pos - 1);
    pos = end;
    std::string_view f[10];
    std::size_t n = 0, i = 0;
    while (n < 10 && i < line.size()) {
      while (i < line.size() && line[i] == ' ') ++i;
      const std::size_t b = i;
      while (i < line.size() && line[i] != ' ') ++i;
      if (i > b) f[n++] = line.substr(b, i - b);
    }
    if (n < 10 || f[3] != "0A") continue;
    const std::size_t colon = f[1].rfind(':');
    unsigned local_port = 0;
    if (colon == std::string_view::npos ||
        std::from_chars(f[1].data() + colon + 1, f[1].data() + f[1].size(), local_port, 16).ec != std::errc() ||
        static_cast<int>(local_port) != port)
      continue;
    TcpListener l;
    if (std::from_chars(f[7].data(), f[7].data() + f[7].size(), l.uid).ec != std::errc() ||
        std::from_chars(f[9].data(), f[9].data() + f[9].size(), l.inode).ec != std::errc())
      continue;
    out.push_back(l);
  }
  return out;
}

namespace {

// The listeners on `port` as the kernel's socket diagnostics tell them (NETLINK_SOCK_DIAG,
// what `ss -ltn` asks): a dump of listening TCP sockets only, which the kernel filters by
// the source port, so its cost follows the listeners, not every connection of the
// machine. nullopt when the socket family is not there (a sandbox without netlink).
std::optional<std::vector<TcpListener>> diag_listeners(int port) {
  Fd fd(::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG));
  if (!fd) return std::nullopt;
  const timeval bound{1, 0};  // the kernel answers at once; a bound all the same
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
  std::vector<TcpListener> out;
  for (const int family : {AF_INET, AF_INET6}) {
    struct {
      nlmsghdr head;
      inet_diag_req_v2 req;
    } ask{};
    ask.head.nlmsg_len = sizeof ask;
    ask.head.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    ask.head.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
    ask.req.sdiag_family = static_cast<std::uint8_t>(family);
    ask.req.sdiag_protocol = IPPROTO_TCP;
    ask.req.idiag_states = 1u << TCP_LISTEN;
    ask.req.id.idiag_sport = htons(static_cast<std::uint16_t>(port));
    sockaddr_nl kernel{};
    kernel.nl_family = AF_NETLINK;
    if (::sendto(fd.get(), &ask, sizeof ask, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) < 0)
      return std::nullopt;
    for (bool done = false; !done;) {
      alignas(nlmsghdr) char buf[16 * 1024];
      const ssize_t got = ::recv(fd.get(), buf, sizeof buf, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return std::nullopt;
      auto len = static_cast<unsigned>(got);
      for (auto* h = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(h, len); h = NLMSG_NEXT(h, len)) {
        if (h->nlmsg_type == NLMSG_DONE) {
          done = true;
          break;
        }
        if (h->nlmsg_type == NLMSG_ERROR) return std::nullopt;
        if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY) continue;
        const auto* m = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
        if (m->idiag_state == TCP_LISTEN && ntohs(m->id.idiag_sport) == port) out.push_back({m->idiag_inode, m->idiag_uid});
      }
    }
  }
  return out;
}

}  // namespace

std::vector<TcpListener> tcp_listeners_on(int port) {
  if (auto asked = diag_listeners(port)) return std::move(*asked);
  // Without netlink: /proc/net/tcp and tcp6, which list every socket (with 10,000 open,
  // 1.5 MB of text a read).
  std::vector<TcpListener> out;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::string text;
    const int fd = ::open(file, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    char buf[64 * 1024];
    for (ssize_t got; (got = ::read(fd, buf, sizeof(buf))) > 0;) text.append(buf, static_cast<std::size_t>(got));
    ::close(fd);
    for (const auto& l : parse_tcp_listeners(text, port)) out.push_back(l);
  }
  return out;
}

std::unordered_set<std::uint64_t> socket_inodes_of(pid_t pid, bool* unreadable) {
  std::unordered_set<std::uint64_t> out;
  const std::string dir = fmt::format("/proc/{}/fd", pid);
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    if (unreadable && (errno == EACCES || errno == EPERM)) *unreadable = true;
    return out;
  }
  while (dirent* e = ::readdir(d)) {
    char target[64] = {};
    const std::string link = dir + "/" + e->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n < 0 && unreadable && (errno == EACCES || errno == EPERM)) *unreadable = true;
    const std::string_view t(target, n > 0 ? static_cast<std::size_t>(n) : 0);
    if (t.size() < 10 || t.substr(0, 8) != "socket:[") continue;
    std::uint64_t inode = 0;
    if (std::from_chars(t.data() + 8, t.data() + t.size() - 1, inode).ec == std::errc()) out.insert(inode);
  }
  ::closedir(d);
  return out;
}

}  // namespace mg

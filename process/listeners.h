// Who listens on a TCP port: the listeners the kernel's socket diagnostics or /proc/net/tcp
// and tcp6 show (this network namespace's), and the sockets a process holds. Part of the
// one /proc reader (process/proc.cc); used by the agent to tell its rank 0's TCPStore from
// a stranger on MASTER_PORT (#35).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace mg {

// A TCP socket listening on a port, from /proc/net/tcp or tcp6 (this network namespace's).
struct TcpListener {
  std::uint64_t inode = 0;
  unsigned uid = 0;  // its owner's uid (the creator's effective uid)
};
// The listeners in the text of /proc/net/tcp or /proc/net/tcp6 on `port` (state 0A). Pure.
std::vector<TcpListener> parse_tcp_listeners(std::string_view text, int port);
// The listeners on `port` of every address, IPv4 and IPv6: asked of the kernel's socket
// diagnostics (netlink, as `ss -ltn`: the kernel lists only the listening sockets of that
// port), read from /proc/net/tcp and tcp6 where netlink is not there.
std::vector<TcpListener> tcp_listeners_on(int port);
// The socket inodes among `pid`'s descriptors (/proc/PID/fd -> "socket:[N]"); empty when gone.
// `unreadable`, when given, is set when the descriptors exist but could not be read (EACCES:
// a process that is not dumpable, prctl(PR_SET_DUMPABLE, 0), read by one without
// CAP_SYS_PTRACE), so an empty answer does not prove the process holds no socket.
std::unordered_set<std::uint64_t> socket_inodes_of(pid_t pid, bool* unreadable = nullptr);

}  // namespace mg

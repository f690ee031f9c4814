// Directory listing with the raw getdents64 system call: no allocation and no lock, so it
// may run in the child of a threaded process before exec and in the watchdog.
#pragma once

#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstddef>

namespace mg {

// Calls f(name) for every entry of the open directory `dir`, reading through `buf`
// (8-byte aligned, `cap` bytes). Async-signal-safe when f is.
template <class F>
void for_each_dirent(int dir, char* buf, std::size_t cap, F&& f) {
  struct Dirent64 {
    ino64_t d_ino;
    off64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[1];
  };
  for (;;) {
    const long n = ::syscall(SYS_getdents64, dir, buf, cap);
    if (n <= 0) return;
    for (long off = 0; off < n;) {
      const auto* e = reinterpret_cast<const Dirent64*>(buf + off);
      off += e->d_reclen;
      f(static_cast<const char*>(e->d_name));
    }
  }
}

}  // namespace mg

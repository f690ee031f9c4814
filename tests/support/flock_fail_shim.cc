// LD_PRELOAD shim for tests: flock() fails with the errno MG_FLOCK_ERRNO names (a number;
// default ENOLCK), as on a file system without locks (NFS mounted nolock, Lustre mounted
// without flock: ENOSYS).
#include <cerrno>
#include <cstdlib>

extern "C" int flock(int /*fd*/, int /*operation*/) {
  const char* e = std::getenv("MG_FLOCK_ERRNO");
  errno = e ? std::atoi(e) : ENOLCK;
  return -1;
}

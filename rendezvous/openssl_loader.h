// Where OpenSSL comes from. The mglaunch executable loads it on first need
// (launcher/openssl_lazy.cc): a run without a rendezvous token and without TLS never maps
// libssl or libcrypto. Everything else that links mg_rendezvous (the daemon, the tests,
// the benchmarks) links OpenSSL as usual, and these weak defaults say so.
#pragma once

#include <string>

namespace mg {

// Makes OpenSSL usable now; false with `error` (what is missing and how to get it) when it
// cannot be loaded. Cheap after the first call; thread-safe.
bool openssl_available(std::string& error);
// As openssl_available(), throwing std::runtime_error("<what> needs OpenSSL: ...").
void require_openssl(const char* what);
// True in the mglaunch executable, where OpenSSL is loaded on first need.
bool openssl_loaded_lazily();

}  // namespace mg

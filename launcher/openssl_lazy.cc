// OpenSSL on first need, for the mglaunch executable only (x86-64; linked as usual
// elsewhere, and in the daemon and the tests): a run without a rendezvous token and
// without TLS to etcd never loads libssl or libcrypto (about 1.7 MiB of the agent's
// resident memory and most of its dynamic relocations).
//
// How: every OpenSSL function the launcher calls (the list below; the test "a standalone
// run maps neither libssl nor libcrypto" catches one missing from it, since the link then
// needs the library again) is defined here as a hidden two-instruction trampoline that
// jumps through a slot. The slots start at a resolver that loads both libraries with
// dlopen and fills every slot; the code that needs OpenSSL loads it up front through
// mg::openssl_available() (main: a token or https:// endpoint), which says clearly what
// is missing, so the resolver's own failure path (a message and exit 1) is only a backstop.
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "rendezvous/openssl_loader.h"

#define MG_OPENSSL_FUNCTIONS(X) \
  X(BIO_ctrl) X(BIO_ctrl_pending) X(BIO_free) X(BIO_new_bio_pair) X(BIO_read) X(BIO_write) X(CRYPTO_free) \
  X(ERR_clear_error) X(ERR_get_error) X(ERR_lib_error_string) X(ERR_reason_error_string) \
  X(EVP_sha256) X(HMAC) X(SSL_CTX_ctrl) X(SSL_CTX_free) X(SSL_CTX_get_default_passwd_cb_userdata) \
  X(SSL_CTX_get_ex_data) X(SSL_CTX_get_verify_callback) X(SSL_CTX_load_verify_locations) X(SSL_CTX_new) \
  X(SSL_CTX_set_default_passwd_cb_userdata) X(SSL_CTX_set_default_verify_paths) X(SSL_CTX_set_ex_data) \
  X(SSL_CTX_set_options) X(SSL_CTX_set_verify) X(SSL_CTX_use_PrivateKey_file) \
  X(SSL_CTX_use_certificate_chain_file) X(SSL_accept) X(SSL_connect) X(SSL_ctrl) X(SSL_free) X(SSL_get_error) \
  X(SSL_get_ex_data) X(SSL_get_ex_data_X509_STORE_CTX_idx) X(SSL_get_shutdown) X(SSL_get_verify_mode) \
  X(SSL_new) X(SSL_read) X(SSL_set_bio) X(SSL_set_ex_data) X(SSL_set_verify) X(SSL_write) X(TLS_client_method) \
  X(TLS_method) X(TLS_server_method) X(X509_STORE_CTX_get_current_cert) X(X509_STORE_CTX_get_error_depth) \
  X(X509_STORE_CTX_get_ex_data) X(X509_check_host) X(X509_check_ip_asc)

extern "C" {
// Loads both libraries or ends the process with a message (the backstop above). Called
// from the trampolines' slow path with the argument registers saved.
__attribute__((visibility("hidden"), used)) void mg_openssl_load_or_die();

#define MG_DECLARE(name)                                                        \
  __attribute__((visibility("hidden"))) void mg_ossl_resolve_##name();          \
  __attribute__((visibility("hidden"), used)) void* mg_ossl_slot_##name =       \
      reinterpret_cast<void*>(&mg_ossl_resolve_##name);
MG_OPENSSL_FUNCTIONS(MG_DECLARE)
#undef MG_DECLARE
}

// name: jump through the slot. mg_ossl_resolve_name (the slot's first value): save the
// argument registers (and rax, the vector count of a variadic call; 7 pushes keep the
// stack 16-byte aligned for the call), load, restore, jump through the filled slot.
#define MG_TRAMPOLINE(name)                                   \
  __asm__(".text\n"                                           \
          ".globl " #name "\n"                                \
          ".hidden " #name "\n"                               \
          ".type " #name ", @function\n" #name ":\n"          \
          "  jmp *mg_ossl_slot_" #name "(%rip)\n"             \
          ".size " #name ", .-" #name "\n"                    \
          ".globl mg_ossl_resolve_" #name "\n"                \
          ".hidden mg_ossl_resolve_" #name "\n"               \
          ".type mg_ossl_resolve_" #name ", @function\n"      \
          "mg_ossl_resolve_" #name ":\n"                      \
          "  push %rdi\n  push %rsi\n  push %rdx\n  push %rcx\n" \
          "  push %r8\n  push %r9\n  push %rax\n"             \
          "  call mg_openssl_load_or_die\n"                   \
          "  pop %rax\n  pop %r9\n  pop %r8\n  pop %rcx\n"    \
          "  pop %rdx\n  pop %rsi\n  pop %rdi\n"              \
          "  jmp *mg_ossl_slot_" #name "(%rip)\n"             \
          ".size mg_ossl_resolve_" #name ", .-mg_ossl_resolve_" #name "\n");
MG_OPENSSL_FUNCTIONS(MG_TRAMPOLINE)
#undef MG_TRAMPOLINE

namespace {

struct Loaded {
  bool ok = false;
  std::string error;
};

const Loaded& load() {
  static std::once_flag once;
  static Loaded result;
  std::call_once(once, [] {
    // libssl first: it loads its libcrypto, the same one we then look up.
    // MGLAUNCH_LIBSSL / MGLAUNCH_LIBCRYPTO: another OpenSSL 3 (a path or a soname).
    auto name = [](const char* var, const char* fallback) {
      const char* v = std::getenv(var);
      return std::string(v && *v ? v : fallback);
    };
    const std::string ssl_name = name("MGLAUNCH_LIBSSL", MGLAUNCH_LIBSSL);
    const std::string crypto_name = name("MGLAUNCH_LIBCRYPTO", MGLAUNCH_LIBCRYPTO);
    void* ssl = ::dlopen(ssl_name.c_str(), RTLD_NOW | RTLD_LOCAL);
    void* crypto = ssl ? ::dlopen(crypto_name.c_str(), RTLD_NOW | RTLD_LOCAL) : nullptr;
    if (!ssl || !crypto) {
      const char* why = ::dlerror();
      result.error = "cannot load OpenSSL, which a rendezvous token and TLS need (" + (ssl ? crypto_name : ssl_name) +
                     "): " + (why ? why : "unknown error") +
                     "; install it (Debian: apt-get install libssl3) or set MGLAUNCH_LIBSSL and MGLAUNCH_LIBCRYPTO";
      return;
    }
    auto find = [&](const char* name, void*& slot) {
      void* p = ::dlsym(ssl, name);
      if (!p) p = ::dlsym(crypto, name);
      if (!p) {
        if (result.error.empty())
          result.error = "the OpenSSL found (" + ssl_name + ") lacks " + name +
                         "; install OpenSSL 3 (Debian: apt-get install libssl3)";
        return;
      }
      __atomic_store_n(&slot, p, __ATOMIC_RELEASE);
    };
#define MG_FIND(name) find(#name, mg_ossl_slot_##name);
    MG_OPENSSL_FUNCTIONS(MG_FIND)
#undef MG_FIND
    result.ok = result.error.empty();
  });
  return result;
}

}  // namespace

extern "C" void mg_openssl_load_or_die() {
  const Loaded& l = load();
  if (l.ok) return;
  const std::string line = "mglaunch: error: " + l.error + "\n";
  (void)!::write(STDERR_FILENO, line.data(), line.size());
  ::_exit(1);
}

namespace mg {

bool openssl_available(std::string& error) {
  const Loaded& l = load();
  if (!l.ok) error = l.error;
  return l.ok;
}

bool openssl_loaded_lazily() { return true; }

}  // namespace mg

// libFuzzer target for what the etcd backend reads from etcd: the gateway's streamed JSON
// (JsonStream, any chunking), base64, endpoint lists, and events replayed into a Job. Any
// bytes must give objects or a std::runtime_error / std::invalid_argument, never a crash,
// undefined behaviour or another exception; a replayed log of arbitrary events must keep
// the Job consistent (tick_due and apply never throw).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "rendezvous/etcd_log.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mg::rdzv::etcd;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    (void)parse_endpoints(text.substr(0, 256));
  } catch (const std::invalid_argument&) {
  }
  try {
    (void)base64_decode(text);
  } catch (const std::invalid_argument&) {
  }
  JsonStream stream(1 << 16);
  JobReplay replay("job", "a");
  const std::size_t chunk = size ? 1 + data[0] % 17 : 1;
  try {
    for (std::size_t i = 0; i < size; i += chunk) {
      stream.feed(text.substr(i, chunk));
      while (auto j = stream.next()) {
        try {
          const Event e = event_from_json(*j);
          (void)replay.apply(e);
          (void)replay.tick_due(e.t_ms + 1000);
          (void)event_from_json(to_json(e));  // what we write we can read back
        } catch (const std::invalid_argument&) {
        }
      }
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}

#include "control/protocol.h"

#include <nlohmann/json.hpp>
#include <fmt/format.h>

namespace mg::control {

using json = nlohmann::json;

LineBuffer::Lines LineBuffer::feed(std::string_view data) {
  Lines out;
  while (!data.empty()) {
    const auto nl = data.find('\n');
    const std::string_view piece = data.substr(0, nl);
    if (partial_.size() + piece.size() > kMaxMessage) {
      out.too_long = true;
      partial_.clear();
      return out;
    }
    partial_.append(piece);
    if (nl == std::string_view::npos) break;
    out.lines.push_back(std::move(partial_));
    partial_.clear();
    data.remove_prefix(nl + 1);
  }
  return out;
}

namespace {

// `field` of `o` as an integer; false (and `bad` set) when present with another type.
template <typename T>
bool int_field(const json& o, const char* field, T& out, std::string& bad) {
  auto it = o.find(field);
  if (it == o.end()) return true;
  if (!it->is_number_integer()) {
    bad = fmt::format("'{}' must be an integer", field);
    return false;
  }
  out = it->get<T>();
  return true;
}

std::string line_of(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n"; }

}  // namespace

FromWorker parse_from_worker(std::string_view line) {
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad{"each message must be one JSON object on one line"};
  auto type = j.find("type");
  if (type == j.end() || !type->is_string()) return Bad{"the message has no \"type\" string"};
  const std::string t = type->get<std::string>();
  std::string bad;
  if (t == "hello") {
    Hello h;
    if (!j.contains("version")) return Bad{"hello needs \"version\" (1)"};
    if (!int_field(j, "version", h.version, bad) || !int_field(j, "pid", h.pid, bad) ||
        !int_field(j, "local_rank", h.local_rank, bad))
      return Bad{"hello: " + bad};
    if (h.version != kVersion)
      return Bad{fmt::format("hello: protocol version {} is not spoken here; this agent speaks version {}", h.version,
                             kVersion)};
    if (auto ip = j.find("in_place"); ip != j.end()) {
      if (!ip->is_boolean()) return Bad{"hello: 'in_place' must be true or false"};
      h.in_place = ip->get<bool>();
    }
    if (auto sb = j.find("standby"); sb != j.end()) {
      if (!sb->is_boolean()) return Bad{"hello: 'standby' must be true or false"};
      h.standby = sb->get<bool>();
    }
    return h;
  }
  if (t == "paused") {
    Paused p;
    if (!int_field(j, "step", p.step, bad)) return Bad{"paused: " + bad};
    return p;
  }
  std::string shown = t.size() > 64 ? t.substr(0, 64) + "..." : t;
  return Bad{fmt::format("unknown message type '{}' (a worker sends hello or paused)", shown)};
}

std::string welcome() { return line_of({{"type", "welcome"}, {"version", kVersion}}); }

std::string pause(int round, std::string_view reason, std::string_view lost) {
  return line_of({{"type", "pause"}, {"round", round}, {"reason", std::string(reason)}, {"lost", std::string(lost)}});
}

std::string assign(int round, int restart_count, const std::map<std::string, std::string>& env) {
  return line_of({{"type", "assign"}, {"round", round}, {"restart_count", restart_count}, {"env", env}});
}

std::string error(std::string_view message) {
  return line_of({{"type", "error"}, {"message", std::string(message)}});
}

std::string at_notation(std::string_view name) { return "@" + std::string(name); }

std::string abstract_address(std::string_view at_name) {
  std::string a(at_name);
  if (!a.empty() && a[0] == '@') a[0] = '\0';
  return a;
}

}  // namespace mg::control

#include "ops/health.h"

#include <charconv>
#include <chrono>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace mg::mon {

int parse_health_port(const std::string& text) {
  int port = -1;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, port);
  if (text.empty() || ec != std::errc() || p != end || port < 0 || port > 65535)
    throw std::invalid_argument(fmt::format("TORCHELASTIC_HEALTH_CHECK_PORT='{}' is not a port: give a number from 0 "
                                            "to 65535 (0: any free port), or unset it",
                                            text));
  return port;
}

rdzv::HttpResponse health_response(const rdzv::HttpRequest& req, const AgentFacts& f, std::int64_t now_s) {
  const std::string path = req.target.substr(0, req.target.find('?'));
  if (req.method != "GET" && req.method != "HEAD") return {405, "text/plain; charset=utf-8", "only GET\n"};
  if (path != "/" && path != "/health") return {404, "text/plain; charset=utf-8", "not found: try /health\n"};
  nlohmann::json workers = {{"running", 0}, {"stopping", 0}, {"exited", 0}, {"failed", 0}};
  for (const RankTarget& r : f.ranks)
    if (workers.contains(r.state)) workers[r.state] = workers[r.state].get<int>() + 1;
  nlohmann::json body = {{"alive", true},          {"last_progress_time", now_s}, {"timeout_s", kHealthTimeoutS},
                         {"run_id", f.run_id},     {"host", f.host},              {"node_rank", f.node_rank},
                         {"round", f.round},       {"restarts", f.restarts},      {"max_restarts", f.max_restarts},
                         {"workers", workers}};
  return {200, "application/json", body.dump() + "\n"};
}

HealthServer::HealthServer(boost::asio::io_context& io, const std::string& host, int port,
                           std::function<AgentFacts()> facts, std::size_t max_connections)
    : facts_(std::move(facts)) {
  try {
    http_ = std::make_unique<rdzv::HttpServer>(io, host, port, [this](const rdzv::HttpRequest& req) {
      const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
      return health_response(req, facts_(), now);
    }, max_connections);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("TORCHELASTIC_HEALTH_CHECK_PORT={}: {}; pick a free port or 0", port,
                                         e.what()));
  }
}

std::string HealthServer::url() const { return fmt::format("http://{}/health", http_->address()); }

}  // namespace mg::mon

// The agent's health-check endpoint: TORCHELASTIC_HEALTH_CHECK_PORT=P, the variable torchrun
// 2.x's agent reads. Stock torchrun hands the port to a HealthCheckServer whose open-source
// start() is a no-op ("No health check server started"); its interface is an alive
// callback (the FileTimer loop's last progress, else the time now) and a 60 s timeout. Here
// the port is a real HTTP endpoint (rendezvous/http.h) served from the agent's event loop:
// GET /health (or /) is answered 200 with a JSON body by that loop, so an answer means the
// agent's loop runs (its last progress is now); a stuck agent does not answer, which a
// prober sees as its timeout. The body says what the agent is doing (attempt, restarts,
// workers by state).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>

#include "ops/monitor.h"
#include "rendezvous/http.h"

namespace mg::mon {

inline constexpr int kHealthTimeoutS = 60;  // torch's create_healthcheck_server(timeout=60)

// The value of TORCHELASTIC_HEALTH_CHECK_PORT: a port 0-65535 (0: any free one). Pure.
// Throws std::invalid_argument naming the variable and the fix.
int parse_health_port(const std::string& text);

// The answer to `req` (pure): GET or HEAD of / or /health: 200, JSON {"alive": true,
// "last_progress_time": now_s, "timeout_s": 60, "run_id", "host", "node_rank", "round",
// "restarts", "max_restarts", "workers": {"running": N, "stopping": N, "exited": N,
// "failed": N}}; another path 404; another method 405.
rdzv::HttpResponse health_response(const rdzv::HttpRequest& req, const AgentFacts& facts, std::int64_t now_s);

class HealthServer {
 public:
  // Listens on `host`:`port` at once. Throws std::runtime_error naming the variable, the
  // address and the fix when it cannot.
  // At most `max_connections` at once (the agent's share for it: sup::descriptor_shares).
  HealthServer(boost::asio::io_context& io, const std::string& host, int port, std::function<AgentFacts()> facts,
               std::size_t max_connections = rdzv::kHttpLimits.max_connections);
  int port() const { return http_->port(); }
  std::string url() const;
  void stop() { http_->stop(); }

 private:
  std::function<AgentFacts()> facts_;
  std::unique_ptr<rdzv::HttpServer> http_;
};

}  // namespace mg::mon

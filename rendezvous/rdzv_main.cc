// mglaunch-rdzv: the rendezvous daemon. Serves many jobs until SIGTERM/SIGINT.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <stdexcept>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "proto/text.h"
#include "rendezvous/auth.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/http.h"
#include "rendezvous/server.h"
#include "rendezvous/status_page.h"
#include "rendezvous/token_strength.h"

namespace {

struct BadFlag : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A whole number in lo..hi; `text` as given to `flag`.
unsigned long long count_in(const char* flag, const std::string& text, unsigned long long lo, unsigned long long hi) {
  unsigned long long v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc{} || p != text.data() + text.size() || v < lo || v > hi)
    throw BadFlag(fmt::format("bad {} '{}': use a whole number in {}..{}", flag, text, lo, hi));
  return v;
}

// Seconds in lo..hi.
std::chrono::milliseconds seconds_in(const char* flag, const std::string& text, double lo, double hi) {
  double v = -1;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc{} || p != text.data() + text.size() || !(v >= lo) || v > hi)
    throw BadFlag(fmt::format("bad {} '{}': use {}..{} seconds", flag, text, lo, hi));
  return std::chrono::milliseconds(static_cast<long long>(v * 1000));
}

}  // namespace

// Every error line: one line, `mglaunch-rdzv: error: ...` (a value may hold a newline).
static void error_line(const std::string& text) {
  std::fprintf(stderr, "mglaunch-rdzv: error: %s\n", mg::cli::one_line(text).c_str());
}

// The operator's log on stderr: one line per event, or one JSON object per line (the
// event's fields, its "text" and the wall-clock "time", ISO 8601 UTC, and "unix_ms").
static std::function<void(const nlohmann::json&)> operator_log(bool json_log) {
  return [json_log](const nlohmann::json& fields) {
    std::string out;
    if (json_log) {
      nlohmann::json j = fields;
      const auto now = std::chrono::system_clock::now();
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
      const std::time_t secs = static_cast<std::time_t>(ms / 1000);
      std::tm utc{};
      ::gmtime_r(&secs, &utc);
      char stamp[32];
      std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &utc);
      j["time"] = fmt::format("{}.{:03}Z", stamp, ms % 1000);
      j["unix_ms"] = ms;
      out = mg::proto::dump_json(j);
    } else {
      out = fmt::format("mglaunch-rdzv: {}", fields.value("text", std::string()));
    }
    std::fprintf(stderr, "%s\n", out.c_str());
  };
}

// --metrics-port's pages: /metrics (the per-job series only for the token's holders
// unless --metrics-job-ids), / a pointer to it.
static mg::rdzv::HttpHandler metrics_page(mg::rdzv::Server& server, const std::string& token, bool metrics_job_ids) {
  return [&server, token, metrics_job_ids](const mg::rdzv::HttpRequest& req) {
    if (req.method != "GET" && req.method != "HEAD")
      return mg::rdzv::HttpResponse{405, "text/plain; charset=utf-8", "only GET and HEAD\n"};
    const std::string& target = req.target;
    if (target == "/metrics") {
      // Job ids are what /api/jobs guards with the token: a scraper without it gets
      // the daemon's totals only.
      const bool job_ids =
          token.empty() || metrics_job_ids || mg::rdzv::auth::equal_ct(req.authorization, "Bearer " + token);
      std::string text = server.metrics(job_ids);
      if (!job_ids)
        text += "# per-job series (job ids) need the daemon's token (Authorization: Bearer TOKEN) or "
                "--metrics-job-ids\n";
      return mg::rdzv::HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8", std::move(text)};
    }
    if (target == "/") return mg::rdzv::HttpResponse{200, "text/plain; charset=utf-8", "mglaunch-rdzv: see /metrics\n"};
    return mg::rdzv::HttpResponse{404, "text/plain; charset=utf-8", "not found: try /metrics\n"};
  };
}

static int run_daemon(int argc, char** argv) {
  std::string listen = "127.0.0.1:0", token_file;
  bool json_log = false;
  bool metrics_job_ids = false;
  // Numbers as text: checked below with their real ranges (CLI11 would print 1.8e308).
  std::string handshake_s = "10", idle_expiry_s = "3600", orphan_expiry_s = "60";
  std::string max_connections, max_per_address = "256", max_frame = std::to_string(mg::proto::kDefaultMaxFrame);
  std::string max_memory_mib = "512";
  std::string frame_timeout_s = "10";
  std::string max_nodes_per_job = "100000";
  std::string job_token_for;
  std::string metrics_port;
  std::string http_listen;
  std::string state_dir;
  CLI::App app{"mglaunch-rdzv: rendezvous daemon for mglaunch agents (--rdzv_backend=mglaunch|c10d)", "mglaunch-rdzv"};
  app.add_option("--listen", listen, "HOST:PORT to listen on (port 0 picks one; default 127.0.0.1:0)");
  app.add_option("--token-file", token_file, "Require agents to prove this token (HMAC-SHA256); or MGLAUNCH_RDZV_TOKEN");
  app.add_flag("--json-log", json_log, "Log one JSON object per line instead of text");
  app.add_option("--max-connections", max_connections, "Refuse connections beyond this many (default: the descriptor limit less 64)");
  app.add_option("--max-connections-per-address", max_per_address,
                 "Refuse connections from one address beyond this many");
  app.add_option("--max-memory", max_memory_mib, "MiB for connection buffers and job state; new work is refused above it");
  app.add_option("--frame-timeout", frame_timeout_s, "Seconds a started frame has to arrive in full");
  app.add_option("--job-token", job_token_for,
                 "Print the key of job ID (derived from the daemon token) and exit: give it to that job's agents as "
                 "MGLAUNCH_RDZV_JOB_TOKEN so they can open that job and no other");
  app.add_option("--metrics-port", metrics_port,
                 "Serve Prometheus metrics at http://LISTEN-HOST:PORT/metrics (0 picks a port; printed second)");
  app.add_flag("--metrics-job-ids", metrics_job_ids,
               "Show job ids (the per-job series) in /metrics to every scraper; with a token they are shown "
               "only to requests carrying Authorization: Bearer TOKEN otherwise");
  app.add_option("--http", http_listen,
                 "Serve the status page and /api/jobs at [HOST:]PORT (default host 127.0.0.1; port 0 picks one; "
                 "printed as 'status page on URL'; with a token the API asks for it)");
  app.add_option("--state-dir", state_dir,
                 "Journal the jobs' events in this directory (it must exist), so that a restarted daemon keeps its "
                 "jobs' history and status page");
  app.add_option("--max-nodes-per-job", max_nodes_per_job, "Refuse jobs whose --nnodes allows more nodes");
  app.add_option("--max-frame", max_frame, "Largest accepted frame in bytes");
  app.add_option("--handshake-timeout", handshake_s, "Seconds a new connection has to authenticate");
  app.add_option("--orphan-job-expiry", orphan_expiry_s, "Forget a job nobody is connected to after this many seconds");
  app.add_option("--idle-job-expiry", idle_expiry_s, "Forget a job after this many idle seconds");
  app.footer("Prints 'listening on HOST:PORT' first (then 'metrics on URL' with --metrics-port). Exit codes: 0 stopped by SIGTERM/SIGINT; 2 bad flags or token "
             "file, or a --state-dir that is missing or not writable; 3 cannot listen (rendezvous, metrics or status page); 4 the "
             "--state-dir journal is damaged or in use by another daemon; 1 internal error.");
  try {
    // argparse's rules as mglaunch: `--flag=` is an empty value, unique prefixes name a flag.
    auto norm = mg::cli::normalize_args(std::vector<std::string>(argv + 1, argv + argc), mg::cli::specs_of(app),
                                        /*stop_at_positional=*/false);
    std::reverse(norm.args.begin(), norm.args.end());
    app.parse(norm.args);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::Error& e) {
    std::string what = e.what();
    error_line(what.substr(0, what.find('\n')) + " (see --help)");
    return 2;
  } catch (const mg::cli::ArgsError& e) {
    error_line(std::string(e.what()) + " (see --help)");
    return 2;
  }
  mg::rdzv::ServerOptions so;
  mg::rdzv::Endpoint http_ep;
  int metrics_port_number = -1;
  try {
    try {
      auto ep = mg::rdzv::parse_endpoint(listen, 0);
      so.host = ep.host;
      so.port = ep.port;
    } catch (const std::invalid_argument& e) {
      throw BadFlag(fmt::format("--listen: {}", e.what()));
    }
    if (app.count("--http") > 0) {
      try {
        http_ep = mg::rdzv::parse_endpoint(
            http_listen.find_first_of(":[") == std::string::npos && !http_listen.empty() ? "127.0.0.1:" + http_listen
                                                                                        : http_listen,
            -1);
        if (http_ep.port < 0) throw std::invalid_argument("give a port, [HOST:]PORT");
      } catch (const std::invalid_argument& e) {
        throw BadFlag(fmt::format("--http '{}': {}", http_listen, e.what()));
      }
    }
    if (app.count("--metrics-port") > 0) metrics_port_number = static_cast<int>(count_in("--metrics-port", metrics_port, 0, 65535));
    if (!max_connections.empty() || app.count("--max-connections") > 0)
      so.max_connections = count_in("--max-connections", max_connections, 1, 1u << 24);
    so.max_connections_per_address = count_in("--max-connections-per-address", max_per_address, 1, 1u << 24);
    so.max_memory = count_in("--max-memory", max_memory_mib, 16, 1u << 20) << 20;
    so.frame_timeout = seconds_in("--frame-timeout", frame_timeout_s, 0.001, 86400);
    so.max_nodes_per_job = static_cast<int>(count_in("--max-nodes-per-job", max_nodes_per_job, 1, 1000000));
    so.max_frame = count_in("--max-frame", max_frame, 4096, 1u << 26);
    so.handshake_timeout = seconds_in("--handshake-timeout", handshake_s, 0.001, 86400);
    so.idle_job_expiry = seconds_in("--idle-job-expiry", idle_expiry_s, 0.001, 31536000);
    so.orphan_job_expiry = seconds_in("--orphan-job-expiry", orphan_expiry_s, 0.001, 31536000);
    if (app.count("--token-file") > 0 && token_file.empty())
      throw BadFlag("--token-file is empty (an unset shell variable?): give the token's file");
    if (app.count("--job-token") > 0 && job_token_for.empty())
      throw BadFlag("--job-token is empty (an unset shell variable?): give the job id");
  } catch (const BadFlag& e) {
    error_line(std::string(e.what()) + " (see --help)");
    return 2;
  }
  if (const char* t = std::getenv("MGLAUNCH_RDZV_TOKEN")) so.token = t;
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    std::getline(in, so.token);
    if (!in && so.token.empty()) {
      error_line(fmt::format("--token-file '{}' cannot be read or is empty; give a file whose first line is the token",
                             token_file));
      return 2;
    }
  }
  if (!so.token.empty())
    if (const std::string w = mg::rdzv::weak_token_warning(
            so.token, token_file.empty() ? std::string("MGLAUNCH_RDZV_TOKEN") : "--token-file " + token_file);
        !w.empty())
      std::fprintf(stderr, "mglaunch-rdzv: warning: %s\n", w.c_str());
  if (!job_token_for.empty()) {
    if (so.token.empty()) {
      error_line("--job-token needs the daemon token (--token-file or MGLAUNCH_RDZV_TOKEN)");
      return 2;
    }
    std::printf("%s\n", mg::rdzv::auth::job_key(so.token, job_token_for).c_str());
    return 0;
  }
  so.log_json = operator_log(json_log);
  so.log = [log = so.log_json](const std::string& line) { log(nlohmann::json{{"event", "log"}, {"text", line}}); };
  if (app.count("--state-dir") > 0) {
    try {
      std::string warning;
      so.journal = std::make_shared<mg::rdzv::Journal>(state_dir, warning);
      if (!warning.empty()) so.log("warning: " + warning);
    } catch (const mg::rdzv::JournalError& e) {
      error_line(e.what());
      return e.kind == mg::rdzv::JournalError::Kind::kBadDir ? 2 : 4;
    }
  }
  boost::asio::io_context io(1);
  std::unique_ptr<mg::rdzv::Server> server;
  try {
    server = std::make_unique<mg::rdzv::Server>(io, so);
  } catch (const std::exception& e) {
    error_line(e.what());
    return 3;
  }
  std::printf("listening on %s\n", server->address().c_str());
  std::unique_ptr<mg::rdzv::HttpServer> metrics;
  if (metrics_port_number >= 0) {
    try {
      metrics = std::make_unique<mg::rdzv::HttpServer>(
          io, so.host, metrics_port_number,
          metrics_page(*server, so.token, metrics_job_ids));
    } catch (const std::exception& e) {
      error_line(fmt::format("--metrics-port: {}", e.what()));
      return 3;
    }
    std::printf("metrics on http://%s/metrics\n", metrics->address().c_str());
  }
  std::unique_ptr<mg::rdzv::HttpServer> status;
  if (app.count("--http") > 0) {
    const mg::rdzv::Endpoint& ep = http_ep;
    try {
      status = std::make_unique<mg::rdzv::HttpServer>(
          io, ep.host, ep.port,
          [&server, token = so.token](const mg::rdzv::HttpRequest& req) { return mg::rdzv::serve_status(*server, token, req); });
    } catch (const std::exception& e) {
      error_line(fmt::format("--http: {}", e.what()));
      return 3;
    }
    std::printf("status page on http://%s/\n", status->address().c_str());
    if (so.token.empty() && !status->loopback())
      so.log(fmt::format("warning: status page on {} without a token: anyone who can reach it can read every job, "
                         "its nodes and the daemon's events; give it a token (--token-file or MGLAUNCH_RDZV_TOKEN)",
                         status->address()));
  }
  std::fflush(stdout);
  boost::asio::signal_set signals(io, SIGTERM, SIGINT);
  signals.async_wait([&](boost::system::error_code, int) {
    server->stop();
    if (metrics) metrics->stop();
    if (status) status->stop();
  });
  io.run();
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run_daemon(argc, argv);
  } catch (const std::exception& e) {
    error_line(fmt::format("internal error: {}", e.what()));
  } catch (...) {
    error_line("internal error: an unknown exception");
  }
  return 1;
}

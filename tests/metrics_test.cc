// mglaunch-rdzv's Prometheus endpoint: the exposition checked by Debian's promtool, and a
// real Prometheus scraping the daemon while a real 2-agent job runs.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/rdzv_fixture.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

struct MetricsDaemon {
  Daemon d;
  int metrics_port = 0;
};

MetricsDaemon start_with_metrics(std::map<std::string, std::string> env = {}, std::vector<std::string> flags = {}) {
  flags.insert(flags.begin(), {"--metrics-port", "0"});
  MetricsDaemon m{start_daemon(env, flags), 0};
  REQUIRE(eventually([&] { return split_lines(m.d.proc.out()).size() >= 2; }, 10s));
  const auto line = split_lines(m.d.proc.out()).at(1);
  REQUIRE(line.rfind("metrics on http://127.0.0.1:", 0) == 0);
  m.metrics_port = std::stoi(line.substr(line.rfind(':') + 1));
  return m;
}

void run_job(const Daemon& d, const std::string& job, const std::map<std::string, std::string>& env = {}) {
  Proc a = spawn(agent_argv(d.endpoint, job, 2, "2", 1, {}, {"print", "ok"}), env);
  Proc b = spawn(agent_argv(d.endpoint, job, 3, "2", 1, {}, {"print", "ok"}), env);
  REQUIRE(a.wait(30s));
  REQUIRE(b.wait(30s));
  REQUIRE(a.exit_code() == 0);
  REQUIRE(b.exit_code() == 0);
}

}  // namespace

TEST_CASE("mglaunch-rdzv serves Prometheus metrics that promtool accepts") {
  require_program("/usr/bin/promtool", "prometheus");
  auto m = start_with_metrics();
  run_job(m.d, "metered");
  const std::string response = http_request(m.metrics_port, "/metrics");
  REQUIRE_THAT(response, Catch::StartsWith("HTTP/1.1 200"));
  const std::string text = body_of(response);
  CHECK_THAT(text, Catch::Contains("mglaunch_rdzv_jobs_created_total 1\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_rdzv_jobs{state=\"done\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_rdzv_job_round{job=\"metered\"} 1\n"));
  CHECK(std::regex_search(text, std::regex("mglaunch_rdzv_frames_received_total [1-9]")));
  CHECK_THAT(http_request(m.metrics_port, "/nothing"), Catch::StartsWith("HTTP/1.1 404"));
  // HEAD: the same headers (the length of the body a GET would get), no body.
  const std::string head = http_request(m.metrics_port, "/metrics", "", "HEAD");
  CHECK_THAT(head, Catch::StartsWith("HTTP/1.1 200"));
  CHECK(std::regex_search(head, std::regex("Content-Length: [1-9]")));
  CHECK(body_of(head).empty());
  {
    const std::string file = make_temp_dir() + "/metrics.txt";
    std::ofstream(file) << text;
    auto check = run({"/bin/sh", "-c", "/usr/bin/promtool check metrics < \"$0\"", file});
    INFO(check.out << check.err);
    CHECK(check.code == 0);
  }
  ::kill(m.d.proc.pid, SIGTERM);
  REQUIRE(m.d.proc.wait(5s));
  CHECK(m.d.proc.exit_code() == 0);
}

TEST_CASE("with a token, /metrics names jobs only to a scraper that carries it, or to all with --metrics-job-ids") {
  require_program("/usr/bin/promtool", "prometheus");
  const std::map<std::string, std::string> token{{"MGLAUNCH_RDZV_TOKEN", "metrics-token"}};
  {
    auto m = start_with_metrics(token);
    run_job(m.d, "secret-job", token);
    const std::string anonymous = http_request(m.metrics_port, "/metrics");
    REQUIRE_THAT(anonymous, Catch::StartsWith("HTTP/1.1 200"));
    INFO(anonymous);
    CHECK_THAT(anonymous, Catch::Contains("mglaunch_rdzv_jobs_created_total 1\n") &&
                              Catch::Contains("mglaunch_rdzv_jobs{state=\"done\"} 1\n") && !Catch::Contains("secret-job"));
    CHECK_THAT(http_request(m.metrics_port, "/metrics", "Bearer wrong"), !Catch::Contains("secret-job"));
    CHECK_THAT(http_request(m.metrics_port, "/metrics", "Bearer metrics-token"),
               Catch::Contains("mglaunch_rdzv_job_round{job=\"secret-job\"} 1\n"));
    {
      const std::string file = make_temp_dir() + "/metrics.txt";
      std::ofstream(file) << body_of(anonymous);
      auto check = run({"/bin/sh", "-c", "/usr/bin/promtool check metrics < \"$0\"", file});
      INFO(check.out << check.err);
      CHECK(check.code == 0);
    }
    ::kill(m.d.proc.pid, SIGTERM);
    m.d.proc.wait(5s);
  }
  auto m = start_with_metrics(token, {"--metrics-job-ids"});
  run_job(m.d, "shown-job", token);
  CHECK_THAT(http_request(m.metrics_port, "/metrics"), Catch::Contains("mglaunch_rdzv_job_round{job=\"shown-job\"} 1\n"));
  ::kill(m.d.proc.pid, SIGTERM);
  m.d.proc.wait(5s);
}

TEST_CASE("a real Prometheus scrapes the daemon with its token and reads back the job count and a job's round") {
  require_program("/usr/bin/prometheus", "prometheus");
  const std::map<std::string, std::string> token{{"MGLAUNCH_RDZV_TOKEN", "scrape-token"}};
  auto m = start_with_metrics(token);
  run_job(m.d, "scraped1", token);
  run_job(m.d, "scraped2", token);
  const std::string dir = make_temp_dir();
  // The README's scrape config for a daemon with a token (the per-job series need it): the
  // token file as the daemon's --token-file would be.
  std::ofstream(dir + "/token") << "scrape-token\n";
  std::ofstream(dir + "/prometheus.yml") << "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: rdzv\n"
                                          << "    authorization: {credentials_file: " << dir << "/token}\n"
                                          << "    static_configs:\n      - targets: ['127.0.0.1:" << m.metrics_port
                                          << "']\n";
  Proc prom = spawn({"/usr/bin/prometheus", "--config.file=" + dir + "/prometheus.yml", "--storage.tsdb.path=" + dir + "/data",
                     "--web.listen-address=127.0.0.1:0"});
  // Prometheus logs the port it bound: address=127.0.0.1:NNNNN on its "Listening on" line.
  int port = 0;
  REQUIRE(eventually([&] {
    std::smatch match;
    const std::string err = prom.err();
    static const std::regex listening("msg=\"Listening on\" address=127\\.0\\.0\\.1:([0-9]+)");
    if (!std::regex_search(err, match, listening)) return false;
    port = std::stoi(match[1]);
    return true;
  }, 60s));
  std::string value;
  CHECK(eventually([&] {
    auto body = body_of(http_request(port, "/api/v1/query?query=mglaunch_rdzv_jobs_created_total"));
    auto j = nlohmann::json::parse(body, nullptr, false);
    if (j.is_discarded() || j["status"] != "success" || j["data"]["result"].empty()) return false;
    value = j["data"]["result"][0]["value"][1].get<std::string>();
    return true;
  }, 60s));
  CHECK(value == "2");
  std::string round;
  CHECK(eventually([&] {
    auto body = body_of(http_request(port, "/api/v1/query?query=mglaunch_rdzv_job_round"));
    auto j = nlohmann::json::parse(body, nullptr, false);
    if (j.is_discarded() || j["status"] != "success") return false;
    // Prometheus keeps its own `job` label (the scrape job) and renames ours exported_job.
    for (const auto& r : j["data"]["result"])
      if (r["metric"].value("exported_job", "") == "scraped2") round = r["value"][1].get<std::string>();
    return !round.empty();
  }, 60s));
  CHECK(round == "1");
  ::kill(prom.pid, SIGTERM);
  prom.wait(20s);
  ::kill(m.d.proc.pid, SIGTERM);
  m.d.proc.wait(5s);
}

TEST_CASE("the status API asks for the daemon's token and lists jobs and events") {
  Daemon d = start_daemon({{"MGLAUNCH_RDZV_TOKEN", "api-token"}}, {"--http", "0"});
  REQUIRE(eventually([&] { return split_lines(d.proc.out()).size() >= 2; }, 10s));
  const auto line = split_lines(d.proc.out()).at(1);
  REQUIRE(line.rfind("status page on http://127.0.0.1:", 0) == 0);
  const int port = std::stoi(line.substr(line.rfind(':') + 1));
  CHECK_THAT(http_request(port, "/"), Catch::StartsWith("HTTP/1.1 200") && Catch::Contains("<title>mglaunch-rdzv</title>"));
  CHECK_THAT(http_request(port, "/api/jobs"), Catch::StartsWith("HTTP/1.1 401"));
  Proc a = spawn(agent_argv(d.endpoint, "api", 2, "2", 1, {}, {"print", "ok"}), {{"MGLAUNCH_RDZV_TOKEN", "api-token"}});
  Proc b = spawn(agent_argv(d.endpoint, "api", 3, "2", 1, {}, {"print", "ok"}), {{"MGLAUNCH_RDZV_TOKEN", "api-token"}});
  REQUIRE(a.wait(30s));
  REQUIRE(b.wait(30s));
  auto get = [&](const std::string& path, const std::string& auth) { return http_request(port, path, auth); };
  CHECK_THAT(get("/api/jobs", "Bearer wrong"), Catch::StartsWith("HTTP/1.1 401"));
  auto jobs = nlohmann::json::parse(body_of(get("/api/jobs", "Bearer api-token")));
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["id"] == "api");
  CHECK(jobs[0]["state"] == "done");
  CHECK(jobs[0]["round"] == 1);
  auto events = nlohmann::json::parse(body_of(get("/api/events?since=0", "Bearer api-token")));
  REQUIRE(!events.empty());
  CHECK_THAT(events[0]["text"].get<std::string>(), Catch::Contains("job 'api' created"));
  const auto last = events.back()["seq"].get<std::uint64_t>();
  CHECK(nlohmann::json::parse(body_of(get("/api/events?since=" + std::to_string(last), "Bearer api-token"))).empty());
  // Its port is taken now: a second daemon cannot serve a page there (3), and a bad value is 2.
  auto taken = run({kRdzvDaemon, "--listen", "127.0.0.1:0", "--http", std::to_string(port)});
  CHECK(taken.code == 3);
  CHECK_THAT(taken.err, Catch::Contains("cannot listen for HTTP on 127.0.0.1:" + std::to_string(port)));
  auto bad = run({kRdzvDaemon, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:notaport"});
  CHECK(bad.code == 2);
  CHECK_THAT(bad.err, Catch::Contains("--http '127.0.0.1:notaport'"));
  ::kill(d.proc.pid, SIGTERM);
  d.proc.wait(5s);
}

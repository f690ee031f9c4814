// ops/trace.h: the Chrome trace events and the streaming writer, under a fake clock.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "ops/trace.h"

using namespace mg;

TEST_CASE("trace events have the fields of the Chrome trace event format") {
  auto x = trace_complete("rank 3", "worker", 42, 4, 1000, 2500, {{"exit_code", 1}});
  CHECK(x["ph"] == "X");
  CHECK(x["ts"] == 1000);
  CHECK(x["dur"] == 2500);
  CHECK(x["pid"] == 42);
  CHECK(x["tid"] == 4);
  CHECK(x["cat"] == "worker");
  CHECK(x["args"]["exit_code"] == 1);
  CHECK(trace_complete("a", "b", 1, 0, 10, -5)["dur"] == 0);  // never negative
  auto i = trace_instant("restart", "restart", 42, 0, 7);
  CHECK(i["ph"] == "i");
  CHECK(i["s"] == "t");
  CHECK(i["args"].is_object());
  auto m = trace_thread_name(42, 2, "local_rank 1");
  CHECK(m["ph"] == "M");
  CHECK(m["name"] == "thread_name");
  CHECK(m["args"]["name"] == "local_rank 1");
}

TEST_CASE("the trace writer streams one JSON array with times relative to its start") {
  std::string out;
  std::int64_t clock = 5000;
  {
    TraceWriter t([&](std::string_view s) { out += s; }, 7, "mglaunch node1 job", [&] { return clock; });
    CHECK(out.rfind("[\n", 0) == 0);  // streamed at once, not at the end
    t.thread_name(TraceWriter::worker_tid(0), "local_rank 0");
    clock = 5100;
    const auto spawned = t.now();
    CHECK(spawned == 100);
    t.instant("spawn rank 0", "worker", TraceWriter::worker_tid(0));
    clock = 5400;
    t.complete("rank 0", "worker", TraceWriter::worker_tid(0), spawned, {{"exit_code", 0}});
    CHECK_FALSE(nlohmann::json::accept(out));  // not closed yet
    t.close();
    t.instant("after close", "agent", 0);  // dropped
  }  // the destructor does not close twice
  auto j = nlohmann::json::parse(out);
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 5);
  CHECK(j[0]["name"] == "process_name");
  CHECK(j[0]["args"]["name"] == "mglaunch node1 job");
  CHECK(j[1]["name"] == "thread_name");
  CHECK(j[1]["args"]["name"] == "agent");
  CHECK(j[2]["tid"] == 1);
  CHECK(j[3]["name"] == "spawn rank 0");
  CHECK(j[3]["ts"] == 100);
  CHECK(j[4]["ph"] == "X");
  CHECK(j[4]["ts"] == 100);
  CHECK(j[4]["dur"] == 300);
  for (const auto& e : j) CHECK(e["pid"] == 7);
}

TEST_CASE("a trace closed at once is still a valid JSON array") {
  std::string out;
  TraceWriter([&](std::string_view s) { out += s; }, 1, "p").close();
  auto j = nlohmann::json::parse(out);
  CHECK(j.size() == 2);  // its process and agent thread names
}

// The daemon's status page (mglaunch-rdzv --http): one HTML page with its script compiled
// into the binary, and its JSON API: /api/jobs (every job, its round, restarts and nodes)
// and /api/events?since=N (the daemon's event lines). With a daemon token the API answers
// only requests carrying "Authorization: Bearer TOKEN" (the page asks for it and keeps it
// in the tab's sessionStorage; it never goes into a URL).
#pragma once

#include <string>

#include "rendezvous/http.h"
#include "rendezvous/server.h"

namespace mg::rdzv {

HttpResponse serve_status(const Server& server, const std::string& token, const HttpRequest& request);

}  // namespace mg::rdzv

#include "logs/filtered_copy.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "process/fd.h"

namespace mg {

FilteredCopy::FilteredCopy(std::string path, std::vector<std::string> filters, std::string prefix, std::size_t max_line)
    : path_(std::move(path)), filters_(std::move(filters)), prefix_(std::move(prefix)), splitter_(max_line) {}

FilteredCopy::~FilteredCopy() {
  if (fd_ >= 0) ::close(fd_);
}

void FilteredCopy::feed(std::string_view data) {
  splitter_.feed(data, [this](std::string_view text, bool) { line(text); });
}

void FilteredCopy::finish() {
  splitter_.finish([this](std::string_view text, bool) { line(text); });
}

void FilteredCopy::line(std::string_view text) {
  if (!error_.empty()) return;
  bool match = false;
  for (const auto& f : filters_)
    if (text.find(f) != std::string_view::npos) match = true;
  if (!match) return;
  if (fd_ < 0) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0666);
    if (fd_ < 0) {
      error_ = fmt::format("cannot open {}: {}", path_, std::strerror(errno));
      return;
    }
  }
  std::string out;
  out.reserve(prefix_.size() + text.size() + 1);
  out.append(prefix_).append(text).append(1, '\n');
  if (!write_fully(fd_, out)) error_ = fmt::format("cannot write {}: {}", path_, std::strerror(errno));
}

}  // namespace mg

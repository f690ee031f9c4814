// FilteredCopy: torch 2.x's --duplicate-stdout-filters / --duplicate-stderr-filters. The
// lines of one worker stream that hold any of the filter strings are appended, with the
// rank's line prefix, to one file of the attempt (filtered_stdout.log, filtered_stderr.log)
// that every tee'd rank of the node shares, as torch's DefaultLogsSpecs does. Each line
// goes out in one write() on an O_APPEND descriptor, so lines of different ranks never mix.
// A line longer than max_line is matched piece by piece, as the console relays it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "logs/line_splitter.h"

namespace mg {

class FilteredCopy {
 public:
  FilteredCopy(std::string path, std::vector<std::string> filters, std::string prefix, std::size_t max_line);
  ~FilteredCopy();
  FilteredCopy(const FilteredCopy&) = delete;
  FilteredCopy& operator=(const FilteredCopy&) = delete;

  // Bytes of the stream as they come; complete lines are matched and copied.
  void feed(std::string_view data);
  // The stream ended: its unfinished last line is matched too.
  void finish();
  // The file could not be opened or written ("" when all is well): what and why.
  const std::string& error() const { return error_; }

 private:
  void line(std::string_view text);

  std::string path_;
  std::vector<std::string> filters_;
  std::string prefix_;
  LineSplitter splitter_;
  int fd_ = -1;  // opened at the first matching line
  std::string error_;
};

}  // namespace mg

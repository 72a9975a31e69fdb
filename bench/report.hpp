#pragma once
// The bench's output: an aligned table on stdout and, with --csv, rows appended to a file. Nothing
// is written before the first row, so a run that fails leaves only its error message.
#include <fstream>
#include <string>

#include "options.hpp"
#include "timing.hpp"

namespace tileattn::bench {

struct Row {
  std::string impl;     // tileattn, naive
  std::string pass;     // fwd, bwd
  std::string problem;  // short description of the shape and mask
  double flops = 0;
  Measurement m;
};

class Report {
 public:
  // `preamble` (the run's description) is printed above the table header.
  Report(Backend backend, std::string device, const std::string& csv_path, std::string preamble);
  // `options` describe the problem the row measured (a sweep changes them row by row), with
  // warmup and iters resolved.
  void add(const Options& options, const Row& row);

 private:
  Backend backend_;
  std::string device_;
  std::string preamble_;
  std::ofstream csv_;
  bool csv_header_needed_ = false;
  bool header_printed_ = false;
};

}  // namespace tileattn::bench

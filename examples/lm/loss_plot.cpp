#include "lm/loss_plot.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>

namespace lm {

namespace {

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (access(candidate.c_str(), X_OK) == 0) return true;
  }
  return false;
}

// gnuplot's single-quoted strings end at the first quote; such names are not drawn.
bool quotable(const std::string& s) {
  return s.find('\'') == std::string::npos && s.find('\n') == std::string::npos;
}

}  // namespace

std::string plot_loss_curve(const std::string& csv, const std::string& title, std::string& why) {
  if (!on_path("gnuplot")) {
    why = "gnuplot is not installed";
    return "";
  }
  const std::string png = std::filesystem::path(csv).replace_extension(".png").string();
  if (!quotable(csv) || !quotable(png) || !quotable(title)) {
    why = "the file name or title holds a quote";
    return "";
  }
  FILE* gp = popen("gnuplot 2>&1", "w");
  if (gp == nullptr) {
    why = "gnuplot could not be started";
    return "";
  }
  std::fprintf(gp,
               "set terminal pngcairo size 900,540 noenhanced\n"
               "set output '%s'\n"
               "set datafile separator ','\n"
               "set key autotitle columnhead\n"
               "set title '%s'\n"
               "set xlabel 'step'\n"
               "set ylabel 'loss (nats per character)'\n"
               "set grid\n"
               "plot '%s' using 1:2 with lines linewidth 2 title 'training loss'\n",
               png.c_str(), title.c_str(), csv.c_str());
  const int status = pclose(gp);
  if (status != 0 || !std::filesystem::exists(png)) {
    why = "gnuplot failed (exit status " + std::to_string(WEXITSTATUS(status)) + ")";
    return "";
  }
  return png;
}

}  // namespace lm

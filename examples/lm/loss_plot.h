#pragma once
// The loss curve as a picture: a PNG drawn by gnuplot from the CSV an example writes, when gnuplot
// is installed (scripts/setup-deps installs it). Without it the CSV is all there is.
#include <string>

namespace lm {

// Draws column 2 (loss) against column 1 (step) of `csv` (with a header line) into the PNG next
// to it (same name, .png). Returns the PNG's path, or "" with the reason in `why` when no picture
// was made: no gnuplot on the PATH, or gnuplot failed.
std::string plot_loss_curve(const std::string& csv, const std::string& title, std::string& why);

}  // namespace lm

#pragma once
// The one way tests check an error: `f` must throw a tessera::Error whose message contains every
// needle (what the user is told is part of the behaviour under test). error_of gives the message
// itself, for tests that compare it across ranks or check that a call throws nothing.
#include <gtest/gtest.h>

#include <initializer_list>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.h"

namespace tessera::testing {

// Failures are reported at the caller's line.
template <class F>
void expect_error(F&& f, const std::vector<std::string>& needles,
                  std::source_location where = std::source_location::current()) {
  const char* file = where.file_name();
  const int line = int(where.line());
  try {
    f();
  } catch (const Error& e) {
    for (const std::string& n : needles)
      if (std::string(e.what()).find(n) == std::string::npos)
        ADD_FAILURE_AT(file, line) << "missing '" << n << "' in: " << e.what();
    return;
  }
  if (needles.empty())
    ADD_FAILURE_AT(file, line) << "expected a tessera::Error";
  else
    ADD_FAILURE_AT(file, line) << "expected an error containing '" << needles.front() << "'";
}

// A braced list of needles picks this one (a one-element list would be ambiguous otherwise).
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> needles,
                  std::source_location where = std::source_location::current()) {
  expect_error(std::forward<F>(f), std::vector<std::string>(needles), where);
}

template <class F>
void expect_error(F&& f, const std::string& needle,
                  std::source_location where = std::source_location::current()) {
  expect_error(std::forward<F>(f), std::vector<std::string>{needle}, where);
}

// The message of the tessera::Error `f` throws, or "" when it does not throw.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace tessera::testing

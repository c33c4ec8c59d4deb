#pragma once
// The check every bad-input test makes: the call throws attnmix::error whose message starts with
// "<fn>: argument '<arg>'" and contains `detail`.

#include <string>

#include "attnmix/core/error.hpp"
#include "support/catch.hpp"

namespace attnmix_test {

template <class Call>
void expect_error(const std::string& fn, const std::string& arg, const std::string& detail,
                  Call&& call) {
  try {
    call();
    FAIL("no attnmix::error for argument '" << arg << "'");
  } catch (const attnmix::error& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.rfind(fn + ": argument '" + arg + "'", 0) == 0);
    CHECK(msg.find(detail) != std::string::npos);
  }
}

}  // namespace attnmix_test

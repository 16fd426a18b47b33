// The message of the sonicmoe::Error a call throws, for tests that assert on what an error says.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>

#include "sonicmoe/error.h"

namespace sonicmoe::testing_util {

// The message of the sonicmoe::Error that fn throws; a test failure if it throws nothing or another type.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-sonicmoe exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no sonicmoe::Error was thrown";
  return "";
}

}  // namespace sonicmoe::testing_util

#pragma once
// Catch2 v3 when installed, else v2 (Debian 12 ships v2).
#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#else
#include <catch2/catch.hpp>
#endif

// The version macros and moefold::version_string equal the package version meson.build declares
// (passed in as MOEFOLD_PACKAGE_VERSION), which moefold.pc and the CMake package carry.
#include <moefold/version.hpp>

#include <doctest/doctest.h>

#include <string>

#ifndef MOEFOLD_PACKAGE_VERSION
#error "tests/meson.build passes MOEFOLD_PACKAGE_VERSION, meson.project_version()"
#endif

TEST_CASE("MOEFOLD_VERSION_* and version_string equal the package version") {
  const std::string package = MOEFOLD_PACKAGE_VERSION;
  const std::string macros = std::to_string(MOEFOLD_VERSION_MAJOR) + "." +
                             std::to_string(MOEFOLD_VERSION_MINOR) + "." +
                             std::to_string(MOEFOLD_VERSION_PATCH);
  CHECK(macros == package);
  CHECK(std::string(moefold::version_string) == package);
  CHECK(moefold::version.major == MOEFOLD_VERSION_MAJOR);
  CHECK(moefold::version.minor == MOEFOLD_VERSION_MINOR);
  CHECK(moefold::version.patch == MOEFOLD_VERSION_PATCH);
}

TEST_CASE("MOEFOLD_VERSION is one integer that orders releases") {
  static_assert(MOEFOLD_VERSION_MINOR < 100 && MOEFOLD_VERSION_PATCH < 100,
                "MAJOR * 10000 + MINOR * 100 + PATCH needs parts below 100");
  CHECK(MOEFOLD_VERSION ==
        MOEFOLD_VERSION_MAJOR * 10000 + MOEFOLD_VERSION_MINOR * 100 + MOEFOLD_VERSION_PATCH);
}

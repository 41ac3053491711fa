// The version macros and moefold::version_string equal the package version meson.build declares
// (passed in as MOEFOLD_PACKAGE_VERSION), which moefold.pc and the CMake package carry.
#include <moefold/version.hpp>

#include <doctest/doctest.h>

#include <string>
#include <type_traits>

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

TEST_CASE("the ABI namespace: moefold::X is moefold::v0_1::X, named after the version") {
  static_assert(std::is_same_v<moefold::version_info, moefold::v0_1::version_info>);
  // While the major version is 0 a minor release may break the ABI: it opens a new namespace
  // (v0_<minor>; then v<major>). tests/packaging/abi_namespace_check.py checks every header.
  static_assert(MOEFOLD_VERSION_MAJOR == 0 && MOEFOLD_VERSION_MINOR == 1,
                "a new ABI version renames the inline namespace");
  CHECK(&moefold::version == &moefold::v0_1::version);
}

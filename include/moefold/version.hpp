//! @file version.hpp
//! @brief The library version, as one integer and as its parts.
#pragma once

// One integer that grows with every release: MAJOR * 10000 + MINOR * 100 + PATCH.
#define MOEFOLD_VERSION_MAJOR 0
#define MOEFOLD_VERSION_MINOR 1
#define MOEFOLD_VERSION_PATCH 0
#define MOEFOLD_VERSION \
  (MOEFOLD_VERSION_MAJOR * 10000 + MOEFOLD_VERSION_MINOR * 100 + MOEFOLD_VERSION_PATCH)

//! Every declaration of moefold lives in the inline namespace moefold::v0_1: user code names
//! moefold::X as always, while the mangled names carry the ABI, so objects compiled against
//! headers of a different ABI fail to link instead of mixing layouts. The name follows the
//! version: v0_<minor> while the major version is 0 (a minor release may change the API), then
//! v<major>.
//! tests/packaging/abi_namespace_check.py keeps every header inside it.
namespace moefold {
inline namespace v0_1 {

struct version_info {
  int major;
  int minor;
  int patch;
};

inline constexpr version_info version{MOEFOLD_VERSION_MAJOR, MOEFOLD_VERSION_MINOR,
                                      MOEFOLD_VERSION_PATCH};
inline constexpr const char* version_string = "0.1.0";

}  // namespace v0_1
}  // namespace moefold

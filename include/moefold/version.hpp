//! @file version.hpp
//! @brief The library version, as one integer and as its parts.
#pragma once

// One integer that grows with every release: MAJOR * 10000 + MINOR * 100 + PATCH.
#define MOEFOLD_VERSION_MAJOR 0
#define MOEFOLD_VERSION_MINOR 1
#define MOEFOLD_VERSION_PATCH 0
#define MOEFOLD_VERSION \
  (MOEFOLD_VERSION_MAJOR * 10000 + MOEFOLD_VERSION_MINOR * 100 + MOEFOLD_VERSION_PATCH)

namespace moefold {

struct version_info {
  int major;
  int minor;
  int patch;
};

inline constexpr version_info version{MOEFOLD_VERSION_MAJOR, MOEFOLD_VERSION_MINOR,
                                      MOEFOLD_VERSION_PATCH};
inline constexpr const char* version_string = "0.1.0";

}  // namespace moefold

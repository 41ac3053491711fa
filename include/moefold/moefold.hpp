//! @file moefold.hpp
//! @brief Umbrella header: everything that compiles without CUDA.
#pragma once

#include "core/checked_int.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/expected.hpp"
#include "mesh/axis.hpp"
#include "mesh/fold.hpp"
#include "mesh/group_list.hpp"
#include "mesh/groups.hpp"
#include "mesh/mesh.hpp"
#include "mesh/order.hpp"
#include "version.hpp"

//! @file plan.hpp
//! @brief The planner: a model of memory and time of an MoE training step under a folded
//! mapping, and a search over every legal folded mapping (docs/planner.md).
#pragma once

#include "calibration.hpp"
#include "cluster.hpp"
#include "collectives.hpp"
#include "efficiency.hpp"
#include "evaluate.hpp"
#include "explain.hpp"
#include "mapping.hpp"
#include "memory.hpp"
#include "model.hpp"
#include "model_flops.hpp"
#include "model_presets.hpp"
#include "placement.hpp"
#include "search.hpp"
#include "shapes.hpp"
#include "step_time.hpp"
#include "validation.hpp"

#pragma once
#include "tileattn/attention.hpp"
#include "tileattn/cpu_executor.hpp"
#include "tileattn/error.hpp"
#include "tileattn/flops.hpp"
#include "tileattn/merge.hpp"
#include "tileattn/problem.hpp"

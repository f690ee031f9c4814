// The watchdog lives in the process layer: process/watchdog.h.
#pragma once

#include "process/watchdog.h"

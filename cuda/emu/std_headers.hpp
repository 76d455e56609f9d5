// std_headers.hpp: the C and C++ library headers the emulator's units include, precompiled
// once per build of the emulator library (build.rs's build.sh: a .gch per set of flags, put
// before every unit with -include). Only the standard library, never a header of cuda/: a
// precompiled header is not checked against the headers it was made from, so one of cuda/'s
// own would hide an edit (a mutant) behind a stale copy. A header missing here is parsed where
// a unit includes it, as without the list.
#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <math.h>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

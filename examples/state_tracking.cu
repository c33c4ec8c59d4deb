// state_tracking built by nvcc: also trains on the GPU (--device cuda).
#include "state_tracking.cpp"

// hybrid_encoder built by nvcc: the CPU run of hybrid_encoder.cpp, then the same encoders on the
// GPU through attnmix::device_stack.
#include "hybrid_encoder.cpp"

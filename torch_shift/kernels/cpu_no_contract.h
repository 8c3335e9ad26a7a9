// Included where every product and sum must round on its own, as PyTorch's separate operators and Python's floats
// do: the compiler contracts no multiply and add into a fused multiply-add in the functions that follow.

#pragma once

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

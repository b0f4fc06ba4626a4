// Vectors whose data starts on a 64-byte boundary. TensorFlow adopts a numpy array returned by the key
// pipeline's tf.numpy_function without copying it only when its data is aligned to Eigen's largest
// alignment (64 bytes); std::vector's memory is 16-byte aligned, so each batch's routing was copied
// once more (measured: 2.4% of a rank's core at 2 ranks, dim 16; a 256 MB array took 17 ms against
// 0.3 ms aligned).
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace shardrec {

template <typename T>
struct CacheAlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheAlignedAllocator() = default;
  template <typename U>
  CacheAlignedAllocator(const CacheAlignedAllocator<U>&) {}  // NOLINT: rebinding, as allocators do
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const CacheAlignedAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheAlignedAllocator<U>&) const { return false; }
};

// A batch's routing arrays (key_exchange.h's FeatureRouting), handed to numpy and on to TensorFlow.
using RoutingVector = std::vector<int32_t, CacheAlignedAllocator<int32_t>>;

}  // namespace shardrec

// A caching allocator for host (CPU) tensors, what a device's caching allocator is to device memory:
// blocks of at least `min_bytes` are kept when freed and handed out again for requests of the same size
// class, instead of going back to the C library. glibc maps every block over 32 MiB afresh (its limit
// for heap blocks) and unmaps it when freed, and its aligned allocations fragment the heap, so an engine
// step that allocates the same large activations every time (a [batch, vocabulary] logits tensor, a prefill
// chunk's MLP activations) page-faults all of them in again every step; a fault costs microseconds on a
// virtual machine. Smaller blocks go to c10's own CPU allocation functions. Installed with
// `torch.ops.unified_cpu.cache_host_allocations`, through c10::SetCPUAllocator; tensors allocated before keep
// their own deleters. Free blocks beyond `max_cached_bytes` are released at once; `empty_host_cache` releases
// all of them.
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <unordered_map>

namespace {

class CachingHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* data = nullptr;
    if (n >= min_bytes_) {
      const size_t size = size_class(n);
      {
        std::lock_guard<std::mutex> guard(mutex_);
        auto it = free_.find(size);
        if (it != free_.end()) {
          data = it->second;
          free_.erase(it);
          cached_bytes_ -= size;
          in_use_[data] = size;
        }
      }
      if (data == nullptr) {
        data = c10::alloc_cpu(size);
        std::lock_guard<std::mutex> guard(mutex_);
        in_use_[data] = size;
      }
    } else {
      data = c10::alloc_cpu(n);
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void configure(size_t min_bytes, size_t max_cached_bytes) {
    std::lock_guard<std::mutex> guard(mutex_);
    min_bytes_ = min_bytes;
    max_cached_bytes_ = max_cached_bytes;
  }

  // Frees every cached block; returns the bytes released.
  size_t empty() {
    std::multimap<size_t, void*> blocks;
    size_t bytes;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      blocks.swap(free_);
      bytes = cached_bytes_;
      cached_bytes_ = 0;
    }
    for (auto& entry : blocks) c10::free_cpu(entry.second);
    return bytes;
  }

  size_t cached_bytes() {
    std::lock_guard<std::mutex> guard(mutex_);
    return cached_bytes_;
  }

  static CachingHostAllocator& instance() {
    static CachingHostAllocator* allocator = new CachingHostAllocator();  // never destroyed: tensors may outlive exit
    return *allocator;
  }

 private:
  // Sizes round up to an eighth of their power of two (at most 12.5% more), so that requests which differ a
  // little (a batch one sequence shorter) share blocks.
  static size_t size_class(size_t n) {
    size_t step = 4096;
    while (step * 16 <= n) step *= 2;
    return (n + step - 1) / step * step;
  }

  static void release(void* data) {
    CachingHostAllocator& self = instance();
    {
      std::lock_guard<std::mutex> guard(self.mutex_);
      auto it = self.in_use_.find(data);
      if (it != self.in_use_.end()) {
        const size_t size = it->second;
        self.in_use_.erase(it);
        if (self.cached_bytes_ + size <= self.max_cached_bytes_) {
          self.free_.emplace(size, data);
          self.cached_bytes_ += size;
          return;
        }
      }
    }
    c10::free_cpu(data);
  }

  std::mutex mutex_;
  size_t min_bytes_ = 1 << 20;
  size_t max_cached_bytes_ = size_t(1) << 30;
  size_t cached_bytes_ = 0;
  std::multimap<size_t, void*> free_;  // cached blocks by size class
  std::unordered_map<void*, size_t> in_use_;  // the blocks of at least min_bytes handed out, by address
};

void cache_host_allocations(int64_t min_bytes, int64_t max_cached_bytes) {
  TORCH_CHECK(min_bytes > 0 && max_cached_bytes >= 0, "cache_host_allocations: positive sizes expected");
  CachingHostAllocator& allocator = CachingHostAllocator::instance();
  allocator.configure(static_cast<size_t>(min_bytes), static_cast<size_t>(max_cached_bytes));
  if (c10::GetCPUAllocator() != &allocator) c10::SetCPUAllocator(&allocator, /*priority=*/100);
}

int64_t empty_host_cache() { return static_cast<int64_t>(CachingHostAllocator::instance().empty()); }

int64_t host_cache_bytes() { return static_cast<int64_t>(CachingHostAllocator::instance().cached_bytes()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) {
  m.def("cache_host_allocations(int min_bytes, int max_cached_bytes) -> ()", &cache_host_allocations);
  m.def("empty_host_cache() -> int", &empty_host_cache);
  m.def("host_cache_bytes() -> int", &host_cache_bytes);
}

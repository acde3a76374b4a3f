// All-reduce (sum) between processes on one machine through a shared-memory segment: tensor parallel's
// row-parallel projections on CPU. gloo's all-reduce goes through TCP on loopback and a wake-up per message
// (0.5-0.7 ms for 64-128 KB here, twice per layer); this one is two memory copies and a spin on a counter.
//
// The segment (a uint8 tensor every rank maps): `world` counters of 64 bytes each (one cache line per rank),
// an abort word on a line of its own (set by whoever learns that a rank died: the waits end at once), then
// two banks of `world` slots. Call `seq` (1, 2, ...: the same on every rank) uses bank seq % 2:
//   1. copy x into this rank's slot of that bank, then publish seq in this rank's counter (release);
//   2. wait until every counter reaches seq (acquire);
//   3. x = the sum of the bank's slots in rank order, so every rank computes the same bits.
// A rank overwrites a bank at call seq + 2 only after every peer published seq + 1, which each does only after
// finishing its reads of call seq: two banks are enough, and no second barrier is needed.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <sched.h>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#define CW_PAUSE() _mm_pause()
#else
#define CW_PAUSE() ((void)0)
#endif

namespace {

constexpr int64_t kCounterBytes = 64;
static_assert(std::atomic<int64_t>::is_always_lock_free, "the counters must be lock-free to work across processes");

std::atomic<int64_t>* counter(uint8_t* base, int64_t rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + rank * kCounterBytes);
}

template <typename T>
void sum_slots(T* out, uint8_t* bank, int64_t slot_bytes, int64_t world, int64_t n) {
  const T* first = reinterpret_cast<const T*>(bank);
  for (int64_t i = 0; i < n; ++i) {
    float acc = static_cast<float>(first[i]);
    for (int64_t r = 1; r < world; ++r) acc += static_cast<float>(reinterpret_cast<const T*>(bank + r * slot_bytes)[i]);
    out[i] = static_cast<T>(acc);
  }
}

void sum_slots_f32(float* out, uint8_t* bank, int64_t slot_bytes, int64_t world, int64_t n) {
  const float* first = reinterpret_cast<const float*>(bank);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = first[i];
  for (int64_t r = 1; r < world; ++r) {
    const float* src = reinterpret_cast<const float*>(bank + r * slot_bytes);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] += src[i];
  }
}

}  // namespace

// x: contiguous, float32 / bfloat16 / float16, at most the slot size. Raises (naming the peer) when a peer has
// not reached call `seq` within timeout_s: it died or is out of step.
void shm_all_reduce(at::Tensor& x, const at::Tensor& segment, int64_t rank, int64_t world, int64_t seq,
                    double timeout_s) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "shm_all_reduce: x must be a contiguous CPU tensor");
  TORCH_CHECK(segment.scalar_type() == at::kByte && segment.is_contiguous(), "shm_all_reduce: a uint8 segment");
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && seq >= 1, "shm_all_reduce: bad rank, world or seq");
  const int64_t header = (world + 1) * kCounterBytes;
  const int64_t slot_bytes = (segment.numel() - header) / (2 * world) / 64 * 64;
  const int64_t nbytes = x.numel() * x.element_size();
  TORCH_CHECK(nbytes <= slot_bytes, "shm_all_reduce: ", nbytes, " bytes do not fit a slot of ", slot_bytes);
  uint8_t* base = segment.data_ptr<uint8_t>();
  uint8_t* bank = base + header + (seq % 2) * world * slot_bytes;
  auto* aborted = counter(base, world);

  std::memcpy(bank + rank * slot_bytes, x.data_ptr(), nbytes);
  counter(base, rank)->store(seq, std::memory_order_release);

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t peer = 0; peer < world; ++peer) {
    auto* c = counter(base, peer);
    for (int64_t spins = 1; c->load(std::memory_order_acquire) < seq; ++spins) {
      CW_PAUSE();
      if (spins % 256 == 0) {
        sched_yield();  // more ranks than cores: let the one we wait for run
        if (aborted->load(std::memory_order_relaxed) != 0) {
          throw std::runtime_error("shared-memory all-reduce: aborted while rank " + std::to_string(rank) +
                                   " waited for rank " + std::to_string(peer) + " (a rank died)");
        }
      }
      if (spins % 4096 == 0 && std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error("shared-memory all-reduce: rank " + std::to_string(rank) + " waited " +
                                 std::to_string(timeout_s) + " s for rank " + std::to_string(peer) +
                                 " at call " + std::to_string(seq) + " (it died or is out of step)");
      }
    }
  }

  const int64_t n = x.numel();
  switch (x.scalar_type()) {
    case at::kFloat:
      sum_slots_f32(x.data_ptr<float>(), bank, slot_bytes, world, n);
      break;
    case at::kBFloat16:
      sum_slots(x.data_ptr<c10::BFloat16>(), bank, slot_bytes, world, n);
      break;
    case at::kHalf:
      sum_slots(x.data_ptr<c10::Half>(), bank, slot_bytes, world, n);
      break;
    default:
      TORCH_CHECK(false, "shm_all_reduce: unsupported dtype ", x.scalar_type());
  }
}

TORCH_LIBRARY_FRAGMENT(chunkwise, m) {
  m.def("shm_all_reduce(Tensor(a!) x, Tensor segment, int rank, int world, int seq, float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(chunkwise, CPU, m) { m.impl("shm_all_reduce", TORCH_FN(shm_all_reduce)); }

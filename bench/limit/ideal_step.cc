// The physical-limit anchor for the 1-rank sparse step: what one core does when nothing but the
// work itself runs. Per batch of the shared workload (keys_fold.npy, 50 x 4096 x 26 int64, the
// same as hidden/bench_sparse.py): dedup keys into a open-addressing key->row map (inserting new
// keys with zero rows), gather each occurrence's row (dim D), loss = sum(emb^2 * w), gradient per
// occurrence 2*emb*w summed per unique row, then lazy Adam (or SGD) on the unique rows only.
// Single thread, no TF, no Python. (shardrec's copy of ../shared/limit/ideal_step.cc: the same loop, and
// it also prints the CPU time per key of both windows, "first_cpu_ns" and "steady_cpu_ns", from
// CLOCK_PROCESS_CPUTIME_ID, which bench/limit.py compares with a rank's.) Prints keys/s over the same windows as the bench:
// "first" = batches 10..39 on a growing table after 10 warm-up batches, "steady" = 100 batches
// after a full pass. Software prefetch (distance PF, default 16) hides the cache misses of the
// map, the rows and the optimizer slots, as a tuned native core would.
//   g++ -O3 -march=native -std=c++17 ideal_step.cc -o ideal_step && ./ideal_step keys_fold.npy lazy_adam 16 [PF]
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static std::vector<int64_t> load_npy(const char* path, size_t& n) {
  FILE* f = fopen(path, "rb");
  if (!f) { perror(path); exit(1); }
  char magic[10]; fread(magic, 1, 10, f);
  uint16_t hl; memcpy(&hl, magic + 8, 2);
  std::string h(hl, ' '); fread(&h[0], 1, hl, f);
  long pos = ftell(f); fseek(f, 0, SEEK_END); long end = ftell(f); fseek(f, pos, SEEK_SET);
  n = (end - pos) / 8; std::vector<int64_t> v(n); fread(v.data(), 8, n, f); fclose(f);
  return v;
}

struct Map {  // open addressing, linear probing, power-of-two capacity
  std::vector<int64_t> keys; std::vector<int32_t> rows; size_t mask; int32_t next = 0;
  explicit Map(size_t cap) : keys(cap, -1), rows(cap, -1), mask(cap - 1) {}
  size_t slot(int64_t k) const { return (uint64_t)k * 0x9E3779B97F4A7C15ull >> 20 & mask; }
  void prefetch(int64_t k) const { size_t h = slot(k); __builtin_prefetch(&keys[h]); __builtin_prefetch(&rows[h]); }
  int32_t find_or_insert(int64_t k) {
    size_t h = slot(k);
    while (true) {
      if (keys[h] == k) return rows[h];
      if (keys[h] == -1) { keys[h] = k; return rows[h] = next++; }
      h = (h + 1) & mask;
    }
  }
};

int main(int argc, char** argv) {
  size_t n; auto all = load_npy(argv[1], n);
  const bool adam = std::string(argv[2]) != "sgd";
  const int D = atoi(argv[3]);
  const int PF = argc > 4 ? atoi(argv[4]) : 16;  // software prefetch distance; 0 = none
  const int NB = 50, B = 4096 * 26;
  const size_t cap_rows = 3000000;
  Map map(1 << 23);
  std::vector<float> val((size_t)cap_rows * D, 0.f), m(adam ? cap_rows * D : 0), v(adam ? cap_rows * D : 0);
  std::vector<float> w(D); for (int d = 0; d < D; ++d) w[d] = 0.01f * (d + 1);
  std::vector<int32_t> occ_row(B), uniq; std::vector<int32_t> pos_of_row(cap_rows, -1);
  std::vector<float> grad; uniq.reserve(B); grad.reserve((size_t)B * D);
  const float lr = 0.001f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f; double loss_sum = 0; long t = 0;
  auto step = [&](int b) {
    const int64_t* k = all.data() + (size_t)(b % NB) * B;
    uniq.clear();
    for (int i = 0; i < B; ++i) {
      if (PF && i + PF < B) map.prefetch(k[i + PF]);
      int32_t r = map.find_or_insert(k[i]); occ_row[i] = r;
      if (pos_of_row[r] < 0) { pos_of_row[r] = (int32_t)uniq.size(); uniq.push_back(r); }
    }
    grad.assign(uniq.size() * D, 0.f);
    double loss = 0;
    for (int i = 0; i < B; ++i) {
      if (PF && i + PF < B) __builtin_prefetch(&val[(size_t)occ_row[i + PF] * D]);
      const float* e = &val[(size_t)occ_row[i] * D]; float* g = &grad[(size_t)pos_of_row[occ_row[i]] * D];
      for (int d = 0; d < D; ++d) { loss += e[d] * e[d] * w[d]; g[d] += 2.f * e[d] * w[d] + 1e-3f; }
    }
    loss_sum += loss; ++t;
    const float c1 = 1.f - std::pow(b1, (float)t), c2 = 1.f - std::pow(b2, (float)t);
    for (size_t u = 0; u < uniq.size(); ++u) {
      if (PF && u + PF < uniq.size()) {
        size_t p = (size_t)uniq[u + PF] * D; __builtin_prefetch(&val[p], 1);
        if (adam) { __builtin_prefetch(&m[p], 1); __builtin_prefetch(&v[p], 1); }
      }
      size_t o = (size_t)uniq[u] * D; const float* g = &grad[u * D];
      if (adam) {
        for (int d = 0; d < D; ++d) {
          m[o + d] = b1 * m[o + d] + (1 - b1) * g[d]; v[o + d] = b2 * v[o + d] + (1 - b2) * g[d] * g[d];
          val[o + d] -= lr * (m[o + d] / c1) / (std::sqrt(v[o + d] / c2) + eps);
        }
      } else {
        for (int d = 0; d < D; ++d) val[o + d] -= 1e-6f * g[d];  // small enough that hot rows stay finite
      }
      pos_of_row[uniq[u]] = -1;
    }
  };
  using clk = std::chrono::steady_clock;
  auto cpu = [] { timespec ts; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; };
  for (int b = 0; b < 10; ++b) step(b);
  double c0 = cpu(); auto t0 = clk::now(); for (int b = 10; b < 40; ++b) step(b);
  double first = 30.0 * B / std::chrono::duration<double>(clk::now() - t0).count();
  double first_cpu_ns = (cpu() - c0) * 1e9 / (30.0 * B);
  for (int b = 40; b < 50; ++b) step(b);
  c0 = cpu(); t0 = clk::now(); for (int b = 50; b < 150; ++b) step(b);
  double steady = 100.0 * B / std::chrono::duration<double>(clk::now() - t0).count();
  double steady_cpu_ns = (cpu() - c0) * 1e9 / (100.0 * B);
  printf("{\"system\": \"ideal_native_1core\", \"opt\": \"%s\", \"dim\": %d, \"first\": %.0f, \"steady\": %.0f, \"rows\": %d, \"loss\": %.3g, \"prefetch\": %d, "
         "\"first_cpu_ns\": %.2f, \"steady_cpu_ns\": %.2f}\n",
         argv[2], D, first, steady, map.next, loss_sum, PF, first_cpu_ns, steady_cpu_ns);
}

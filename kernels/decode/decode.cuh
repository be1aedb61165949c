// decode.cuh: attention of a few query rows per sequence against a KV cache
// (cuflash.attention_kvcache), and the append that writes new keys into it.
//
// Decoding reads the whole cache for a handful of rows, so the kernel is built to
// stream K and V: a block takes one sequence, one K/V entry (head) and one split of
// its keys; the query rows that share the entry (the group's heads times the new
// rows) are packed into one tile of 16 * M_TILES rows, so each key is read once per
// entry. K and V blocks of BLOCK_N keys stream through a multi-stage cp.async
// pipeline; each of the four warps takes a quarter of a block's keys for all the rows,
// with its own online softmax, and the warps' partial results are merged at the end. With
// several splits each block writes a float32 partial (out, lse) and counts itself
// done; the last block of its rows to finish merges the splits' partials by
// logsumexp (one launch, and the merge starts as the last split ends). On Hopper the
// splits are launched in clusters instead, and the blocks keep their partials in shared
// memory and merge them together, reading each other's; where a row group's splits take
// several clusters, the clusters' merged parts then meet through global memory as above.
#pragma once

namespace cuflash {

struct DecodeParams {
    const void* q;            // (B, E, G * nq, d): rows contiguous per (b, e)
    const void* k;            // (B or pages, E, rows, d), strided
    const void* v;
    void* out;                // (B, E, G * nq, dv) contiguous
    float* lse;               // (B, E, G * nq)
    const int* seqlens;       // (B) keys already cached, or null: seqlen_all
    const int* block_table;   // (B, max_pages), or null: contiguous cache
    float* part_out;          // (splits or clusters per row group, B * E * G * nq, dv), with splits > 1
    float* part_lse;          // (splits, B * E * G * nq)
    unsigned* split_counts;   // (B * E * row groups [* cluster ranks]): blocks done, back to 0 after the last (zero to begin)
    const void* k_new;        // (B, E, n_new, d) strided, for the append
    const void* v_new;
    const float* alibi_slopes;   // (B, E, G) or null, as AttnParams'
    const float* sinks;
    const void* user_args;       // the call's score and mask functions' arguments (UserScores), or null
    index_t q_stride_b, q_stride_e, q_stride_row;
    index_t k_stride_b, k_stride_e, k_stride_row;   // b: a sequence's cache, or a page
    index_t v_stride_b, v_stride_e, v_stride_row;
    index_t kn_stride_b, kn_stride_e, kn_stride_row;
    index_t vn_stride_b, vn_stride_e, vn_stride_row;
    index_t batch, entries, rows, nq, d, dv, n_new;
    index_t seqlen_all;
    index_t capacity;          // keys a sequence can hold: Nmax, or max_pages * page_size
    index_t page_size, page_div, num_pages, max_pages;   // page_div: fast_div's constant for page_size
    index_t window_left, window_right;   // as AttnParams
    float scale_log2, scale_log2_lo;     // as AttnParams
    index_t splits, split_keys;          // keys per split: a multiple of the key block
    // Score modifiers (score_path.cuh; sinks on every path): as AttnParams, slopes and sinks one
    // per query head of the flat batch (B, E, G), (b * E + e) * G + row / nq
    float cap, cap_inv, unscale, slope_unit;

    // Keys already in sequence b's cache, as given (possibly out of range).
    __device__ __forceinline__ int cached(int b) const { return seqlens ? seqlens[b] : int(seqlen_all); }
    // The keys sequence b attends once its new keys are in: clamped to the cache.
    __device__ __forceinline__ int length(int b) const {
        return int(min(max(index_t(cached(b)) + n_new, index_t(0)), capacity));
    }
    // Where key j of sequence b lives: the table's entry for its page, as given (b itself in
    // a contiguous cache; slot() clamps it to the pages there are, apart, so that a read
    // ahead of time is not waited for at once), and its row there.
    __device__ __forceinline__ int table_entry(int b, int j) const {
        return block_table ? __ldg(block_table + index_t(b) * max_pages + page_index(j)) : b;
    }
    __device__ __forceinline__ int slot(int entry) const {
        return block_table ? min(max(entry, 0), int(num_pages) - 1) : entry;
    }
    __device__ __forceinline__ int row_of(int j) const {
        return block_table ? j - page_index(j) * int(page_size) : j;
    }
    __device__ __forceinline__ int page_index(int j) const { return int(fast_div(u32(j), page_div)); }
    // Offsets in k and v of row `row` of slot `at` (a sequence's cache, or a page), and of
    // key j of sequence b, from the first row of slot 0 of the same entry (head): callers
    // start from their entry's, its offsets e * k_stride_e and e * v_stride_e.
    __device__ __forceinline__ void offsets(int at, int row, index_t& ok, index_t& ov) const {
        ok = at * k_stride_b + row * k_stride_row;
        ov = at * v_stride_b + row * v_stride_row;
    }
    __device__ __forceinline__ void key_offsets(int b, int j, index_t& ok, index_t& ov) const {
        offsets(slot(table_entry(b, j)), row_of(j), ok, ov);
    }
};

#ifdef CUFLASH_DECODE_PARAMS_BYTES
static_assert(sizeof(DecodeParams) == CUFLASH_DECODE_PARAMS_BYTES, "DecodeParams differs from cuflash/_params.py");
#endif

// k_new, v_new row i of (b, e) into the cache at key cached(b) + i; positions outside
// [0, capacity) are dropped. One block per (b, e, i), threads over the head dim.
template <class T>
__global__ void __launch_bounds__(128) kvcache_append(const DecodeParams p) {
    using Storage = typename T::storage;
    wait_for_prior_grids();
    allow_dependent_grids();
    const index_t n = index_t(blockIdx.x);
    const int i = int(n % p.n_new), e = int(n / p.n_new % p.entries), b = int(n / (p.n_new * p.entries));
    const index_t j = index_t(p.cached(b)) + i;
    if (j < 0 || j >= p.capacity) return;
    index_t ok, ov;
    p.key_offsets(b, int(j), ok, ov);
    const Storage* kn = static_cast<const Storage*>(p.k_new) + b * p.kn_stride_b + e * p.kn_stride_e + i * p.kn_stride_row;
    const Storage* vn = static_cast<const Storage*>(p.v_new) + b * p.vn_stride_b + e * p.vn_stride_e + i * p.vn_stride_row;
    Storage* k = static_cast<Storage*>(const_cast<void*>(p.k)) + e * p.k_stride_e + ok;
    Storage* v = static_cast<Storage*>(const_cast<void*>(p.v)) + e * p.v_stride_e + ov;
    for (int c = threadIdx.x; c < int(p.d); c += blockDim.x) k[c] = kn[c];
    for (int c = threadIdx.x; c < int(p.dv); c += blockDim.x) v[c] = vn[c];
}

// Copies rows [0, ROWS) x cols [0, COLS) of a tile whose row r starts at row_ptr(r)
// (rows >= rows_valid and cols >= cols_valid become zeros); all THREADS take part.
template <class Tile, int THREADS, class Storage, class RowPtr>
__device__ __forceinline__ void load_rows_async(u32 s_tile, RowPtr row_ptr, int rows_valid, int cols_valid) {
    constexpr int TOTAL = Tile::ROWS_X_CHUNKS;
#pragma unroll
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
        const int i = it * THREADS + int(threadIdx.x);
        if (TOTAL % THREADS != 0 && i >= TOTAL) break;
        const int r = i / Tile::CHUNKS, c = i % Tile::CHUNKS;
        const bool valid = r < rows_valid && c * Tile::ELEMS_PER_CHUNK < cols_valid;
        const Storage* src = valid ? row_ptr(r) + c * Tile::ELEMS_PER_CHUNK : row_ptr(0);
        cp_async_16(s_tile + Tile::chunk_offset(r, c), src, valid);
    }
}

// How a block of keys maps to memory, fixed per kernel so that each holds only its own
// copy loop (one loop's code, short enough to stay in the instruction cache):
// BLOCKS: one strided run found with one table read (a contiguous cache, or pages that
// hold whole blocks); RUNS: pages of whole 16-row runs, one table read per run; ROWS:
// any page size, every row looked up.
enum class KeyLayout : int { BLOCKS = 0, RUNS = 1, ROWS = 2 };

// The decoding kernel's block: four warps, BLOCK_N keys per pipeline stage (BLOCK_N / 4
// per warp, 64 or 128: narrow heads take more keys per stage, so that a stage moves as many
// bytes and its fixed costs, the barrier and the softmax's reductions, spread over more).
template <int BLOCK_N_>
struct DecodeTiles {
    static constexpr int WARPS = 4;
    static constexpr int BLOCK_N = BLOCK_N_;
    static constexpr int WARP_KEYS = BLOCK_N / WARPS;   // a warp's keys of a block: 16 or 32
    static constexpr int RUN = 16;                      // keys of one run in pages of 16
    // the most splits a call launched in clusters has (cuflash/_dispatch.py: DECODE_MAX_CLUSTER;
    // 16 needs the non-portable cluster size, which Hopper allows)
    static constexpr int MAX_CLUSTER = 16;
    static constexpr int GROUP_BATCH = 4;   // clusters' parts (two-level merge) loaded at once
    static_assert(WARP_KEYS % 16 == 0, "a warp takes whole 16-key products");
};

// grid: (B * E, splits, row groups of 16 * M_TILES): the long dim in x, which has room for it.
// Scores: the score path (score_path.cuh: PlainScores, ModifiedScores, or UserScores with the
// call's own functions); a row's sink joins the softmax of split 0 only, so that the merge of the
// splits by logsumexp counts it once.
// TWO_LEVEL: launched in several clusters per row group (Hopper), whose merged parts meet
// through global memory. A kernel of its own: that path's code, present but not taken,
// made the short calls merged in one cluster 0.3 us slower (docs/design.md, "KV cache and
// decoding").
template <class T, int HEAD_DIM, int M_TILES, int STAGES, int BLOCK_N, int LAYOUT, bool TWO_LEVEL, class Scores>
__global__ void __launch_bounds__(DecodeTiles<BLOCK_N>::WARPS * 32, 1) attn_decode(const DecodeParams p) {
    using Storage = typename T::storage;
    using Tiles = DecodeTiles<BLOCK_N>;
    constexpr int ROWS = 16 * M_TILES, THREADS = Tiles::WARPS * 32, D_TILES = HEAD_DIM / 8;
    constexpr int N_TILES = Tiles::WARP_KEYS / 8;
    using QTile = SmemTile<Storage, ROWS, HEAD_DIM>;
    using KVTile = SmemTile<Storage, BLOCK_N, HEAD_DIM>;
    using SubTile = SmemTile<Storage, Tiles::WARP_KEYS, HEAD_DIM>;   // one warp's keys of a K or V block
    using RunTile = SmemTile<Storage, Tiles::RUN, HEAD_DIM>;
    constexpr u32 SUB_BYTES = SubTile::BYTES, RUN_BYTES = RunTile::BYTES;

    extern __shared__ __align__(128) unsigned char smem[];
    wait_for_prior_grids();   // (launched programmatically: the kernel before may still be writing)
    allow_dependent_grids();
    const int be = blockIdx.x, split = blockIdx.y, b = be / int(p.entries), e = be % int(p.entries);
    const int row0 = blockIdx.z * ROWS, rows = min(ROWS, int(p.rows) - row0);
    const int nq = int(p.nq), d = int(p.d), dv = int(p.dv), warp = threadIdx.x / 32;
    const int nk = p.length(b);
    const int k_begin = split * int(p.split_keys), k_end = min(nk, k_begin + int(p.split_keys));

    const u32 s_q = smem_address(smem);
    const u32 s_k = s_q + QTile::BYTES;                // + stage * KVTile::BYTES
    const u32 s_v = s_k + STAGES * KVTile::BYTES;
    const auto* g_q = static_cast<const Storage*>(p.q) + b * p.q_stride_b + e * p.q_stride_e;
    const auto* g_k = static_cast<const Storage*>(p.k) + e * p.k_stride_e;   // the block's entry
    const auto* g_v = static_cast<const Storage*>(p.v) + e * p.v_stride_e;

    // Keys [lo, hi) that some row of the block may see: the band of its new rows
    const int off = nk - nq;
    const int r_first = row0 % nq, r_last = (row0 + rows - 1) % nq;
    const bool every_row = rows >= nq || r_first > r_last;   // the block's rows cover (or wrap past) all nq
    const int q_lo = every_row ? 0 : r_first, q_hi = every_row ? nq - 1 : r_last;
    const int lo = max(k_begin, int(max(index_t(0), q_lo + off - p.window_left)));
    const int hi = min(k_end, int(min(index_t(nk), q_hi + off + p.window_right + 1)));
    const int nb_begin = lo / BLOCK_N, nb_end = hi > lo ? ceil_div(hi, BLOCK_N) : nb_begin;

    // (the host picks LAYOUT from the page size: _tiles.decode_tiles)
    static_assert(LAYOUT != int(KeyLayout::RUNS) || (HEAD_DIM <= 128 && BLOCK_N % Tiles::RUN == 0),
                  "runs of 16 rows for heads up to 128 wide (wider: the runs' offsets would spill)");
    // A block's keys lie in SPANS runs of one page each (one for BLOCKS). Each run is copied
    // by its own LANES threads, which alone read its table entry and compute its addresses
    // (one run, not every run, per thread). The entries are read LOOKAHEAD blocks before
    // their copies, so that the table's latency hides under the products between rather than
    // stalling every copy (a contiguous cache reads no table). entries[s]: this thread's run
    // of the block s after the next one to load.
    constexpr int SPAN = LAYOUT == int(KeyLayout::RUNS) ? Tiles::RUN : BLOCK_N;
    constexpr int SPANS = BLOCK_N / SPAN, LANES = THREADS / SPANS, LOOKAHEAD = STAGES - 1;
    static_assert(THREADS % SPANS == 0, "each run of a block has threads of its own");
    const int run = int(threadIdx.x) / LANES, lane = int(threadIdx.x) % LANES;
    int entries[LOOKAHEAD] = {};
    auto fetch_entry = [&](int nb, int& out) {
        if constexpr (LAYOUT != int(KeyLayout::ROWS)) {   // (rows: looked up row by row as copied)
            // (a run past the last key is all zeros: its first row clamped to one that exists)
            if (nb < nb_end) out = p.table_entry(b, min(nb * BLOCK_N + run * SPAN, nk - 1));
        }
    };
    auto load_kv = [&](int nb, int stage) {
        const int n0 = nb * BLOCK_N, valid = min(BLOCK_N, nk - n0);
        const u32 s_kb = s_k + stage * KVTile::BYTES, s_vb = s_v + stage * KVTile::BYTES;
        if constexpr (LAYOUT == int(KeyLayout::BLOCKS)) {
            index_t ok, ov;
            p.offsets(p.slot(entries[0]), p.row_of(n0), ok, ov);
            // (strided: each thread steps down the rows by constants; all but a sequence's
            // last block are whole, and take copies with no predicates)
            if (valid == BLOCK_N && d == HEAD_DIM && dv == HEAD_DIM) {
                load_whole_tile_async<KVTile, THREADS>(s_kb, g_k + ok, p.k_stride_row);
                load_whole_tile_async<KVTile, THREADS>(s_vb, g_v + ov, p.v_stride_row);
            } else {
                load_tile_async<KVTile, THREADS, true>(s_kb, g_k + ok, p.k_stride_row, valid, d);
                load_tile_async<KVTile, THREADS, true>(s_vb, g_v + ov, p.v_stride_row, valid, dv);
            }
        } else if constexpr (LAYOUT == int(KeyLayout::RUNS)) {
            index_t ok, ov;
            p.offsets(p.slot(entries[0]), p.row_of(min(n0 + run * SPAN, nk - 1)), ok, ov);
            const int run_valid = valid - run * SPAN;
            load_tile_by_lanes_async<RunTile, LANES>(s_kb + run * RUN_BYTES, g_k + ok, p.k_stride_row, run_valid, d, lane);
            load_tile_by_lanes_async<RunTile, LANES>(s_vb + run * RUN_BYTES, g_v + ov, p.v_stride_row, run_valid, dv, lane);
        } else {
            auto k_row = [&](int r) { index_t ok, ov; p.key_offsets(b, n0 + min(r, valid - 1), ok, ov); return g_k + ok; };
            auto v_row = [&](int r) { index_t ok, ov; p.key_offsets(b, n0 + min(r, valid - 1), ok, ov); return g_v + ov; };
            load_rows_async<KVTile, THREADS, Storage>(s_kb, k_row, valid, d);
            load_rows_async<KVTile, THREADS, Storage>(s_vb, v_row, valid, dv);
        }
    };
    // the loads of step i (i < 0: the prologue's), one cp.async group each; then the
    // entries move up a block and the table read for the block LOOKAHEAD further goes out
    auto load_step = [&](int i) {
        const int nb = nb_begin + i + STAGES - 1;
        if (nb < nb_end) load_kv(nb, (i + STAGES - 1) % STAGES);
        cp_async_commit();
#pragma unroll
        for (int s = 0; s + 1 < LOOKAHEAD; ++s) entries[s] = entries[s + 1];
        fetch_entry(nb + LOOKAHEAD, entries[LOOKAHEAD - 1]);
    };

    float acc[M_TILES][D_TILES][4];
    fill_zero(acc);
    OnlineSoftmax<T, M_TILES> softmax(p.scale_log2_lo);
    const float scale_log2 = p.scale_log2;
    // (a ScorePath built where it is used: one held across the loop keeps the parameters'
    // address and cost the plain float32 kernels a register)
    using Path = ScorePath<T, Scores, DecodeParams, false>;   // (no bias on the cache)
    // (modified scores) each of the thread's rows' query head (flat row / nq: its entry of q's
    // batch), its ALiBi slope, and its query's position against the keys, row % nq + nk - nq
    float slopes[M_TILES][2] = {};
    int at[M_TILES][2] = {};
    u32 heads[M_TILES][2] = {};
    if constexpr (Scores::MODIFIED) {
        const int g = (threadIdx.x % 32) / 4;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = min(mt * 16 + g + 8 * h, rows - 1);   // (rows past `rows` are never written)
                heads[mt][h] = u32((index_t(be) * p.rows + row0 + r) / nq);
                slopes[mt][h] = Path(p).slope_of(heads[mt][h]);
                at[mt][h] = (row0 + r) % nq + off;
            }
    }

    if (nb_begin < nb_end) {
        load_rows_async<QTile, THREADS, Storage>(
            s_q, [&](int r) { return g_q + (row0 + r) * p.q_stride_row; }, rows, d);
#pragma unroll
        for (int s = 0; s < LOOKAHEAD; ++s) fetch_entry(nb_begin + s, entries[s]);   // all in flight at once
#pragma unroll
        for (int i = 1 - STAGES; i < 0; ++i) load_step(i);
    }
    for (int nb = nb_begin; nb < nb_end; ++nb) {
        const int i = nb - nb_begin, stage = i % STAGES;
        cp_async_wait<STAGES - 2>();   // block i (and Q) have landed
        __syncthreads();               // ... everywhere, and step i-1 is done with its stage
        load_step(i);

        typename T::dot_sum s[M_TILES][N_TILES][4];
        fill_zero(s);
        const u32 s_k_warp = s_k + stage * KVTile::BYTES + warp * SUB_BYTES;
        // (rolled over the head dim where the accumulators are large: hoisted loads would spill)
        constexpr int QK_UNROLL = M_TILES * D_TILES * 4 >= 128 ? 1 : T::K_UNROLL;
        mma_rows_rows<T, QTile, SubTile, HEAD_DIM, QK_UNROLL>(s, s_q, 0, s_k_warp);
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
        const int key0 = nb * BLOCK_N + warp * Tiles::WARP_KEYS, key_last = key0 + Tiles::WARP_KEYS - 1;
        Path(p).modify_rows(s, slopes, at, heads, key0);
        // the band per row: row r of the block is new row (row0 + r) % nq. The warp's keys
        // need it only where the split's ends or the band's edges cut them (rows past
        // `rows` read zeros from Q and are never written, masked or not).
        const bool cut = key0 < k_begin || key_last >= k_end || key_last > q_lo + off + p.window_right ||
                         index_t(key0) < q_hi + off - p.window_left;
        if (cut) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        const int r = mt * 16 + g + 8 * (x >> 1), j = key0 + nt * 8 + 2 * t + (x & 1);
                        const int qi = (row0 + r) % nq;
                        const bool seen = r < rows && j >= k_begin && j < k_end && j <= qi + off + p.window_right &&
                                          index_t(j) >= qi + off - p.window_left;
                        if (!seen) s[mt][nt][x] = -CUFLASH_INF;
                    }
            softmax.template update_warp<true>(s, acc, scale_log2);
        } else {   // (a score or mask function may make -inf anywhere: USER)
            softmax.template update_warp<Scores::USER>(s, acc, scale_log2);
        }
        mma_regs_cols<T, SubTile>(acc, s, s_v + stage * KVTile::BYTES + warp * SUB_BYTES, 0);
    }
    cp_async_wait<0>();
    __syncthreads();   // the K/V stages are free: the warps' merge reuses them

    // Merge the warps' (m, l, acc) per row through shared memory: each warp's
    // weight is exp2((m_w - m) * scale_log2) against the row's best m.
    float* s_m = reinterpret_cast<float*>(smem + QTile::BYTES);   // [warp][ROWS]
    float* s_l = s_m + Tiles::WARPS * ROWS;                        // [warp][ROWS]
    float* s_acc = s_l + Tiles::WARPS * ROWS;                      // [warp][ROWS][HEAD_DIM]
    {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mt * 16 + g + 8 * h;
                const float l = quad_sum(softmax.l[mt][h]);
                if (t == 0) {
                    s_m[warp * ROWS + r] = softmax.m[mt][h];
                    s_l[warp * ROWS + r] = l;
                }
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) {
                    s_acc[(warp * ROWS + r) * HEAD_DIM + dt * 8 + 2 * t] = acc[mt][dt][2 * h];
                    s_acc[(warp * ROWS + r) * HEAD_DIM + dt * 8 + 2 * t + 1] = acc[mt][dt][2 * h + 1];
                }
            }
    }
    __syncthreads();
    const bool parts = p.splits > 1;
    // (clusters: the splits of these rows are this cluster's blocks, and the parts stay here)
    const bool clustered = TWO_LEVEL || (parts && cluster_blocks() > 1);
    float* s_part = s_acc + Tiles::WARPS * ROWS * HEAD_DIM;   // [ROWS][HEAD_DIM], then lse [ROWS]
    float* s_part_lse = s_part + ROWS * HEAD_DIM;
    const index_t out_row0 = index_t(be) * p.rows + row0;
    for (int r = warp; r < rows; r += Tiles::WARPS) {
        // the row's reference m: the best (largest scaled) m among the warps that saw a key
        // (l != 0: positive, or NaN from NaN inputs, which then stays NaN)
        float best = -CUFLASH_INF;
        bool any = false;
#pragma unroll
        for (int w = 0; w < Tiles::WARPS; ++w) {
            const float m = s_m[w * ROWS + r];
            if (s_l[w * ROWS + r] != 0.f) {
                best = !any ? m : (scale_log2 >= 0.f ? fmaxf(best, m) : fminf(best, m));
                any = true;
            }
        }
        float weight[Tiles::WARPS], total = 0.f;
#pragma unroll
        for (int w = 0; w < Tiles::WARPS; ++w) {
            const float m = s_m[w * ROWS + r], l = s_l[w * ROWS + r];
            weight[w] = l != 0.f ? exp2_p<T>(softmax.template exponent<0>(m - best, scale_log2)) : 0.f;
            total += weight[w] * l;
        }
        float inv, row_lse;
        if (p.sinks && split == 0) {
            const float sink2 = Path(p).sink2_of(u32((out_row0 + r) / nq));
            row_lse = OnlineSoftmax<T, M_TILES>::lse_with_sink(best, total, scale_log2, sink2, inv);
        } else {
            inv = total == 0.f ? 0.f : 1.f / total;
            row_lse = OnlineSoftmax<T, M_TILES>::lse_from(best, scale_log2, log2f(total), total == 0.f);
        }
        for (int c = threadIdx.x % 32; c < (clustered ? HEAD_DIM : dv); c += 32) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < Tiles::WARPS; ++w) o += weight[w] * s_acc[(w * ROWS + r) * HEAD_DIM + c];
            o *= inv;
            if (clustered) s_part[r * HEAD_DIM + c] = o;
            else if (parts) p.part_out[(index_t(split) * p.batch * p.entries * p.rows + out_row0 + r) * dv + c] = o;
            else Store<T>::one(static_cast<Storage*>(p.out) + (out_row0 + r) * dv + c, saturate<T>(o));
        }
        if (threadIdx.x % 32 == 0) {
            if (clustered) s_part_lse[r] = row_lse;
            else if (parts) p.part_lse[index_t(split) * p.batch * p.entries * p.rows + out_row0 + r] = row_lse;
            else p.lse[out_row0 + r] = row_lse;
        }
    }
    if (!parts) return;
    const index_t total_rows = p.batch * p.entries * p.rows;
    if (clustered) {
        auto store_out = [&](index_t row, int c, float4 o, float l) {
            Storage* dst = static_cast<Storage*>(p.out) + row * dv + c;
            Store<T>::pair(dst, saturate<T>(o.x), saturate<T>(o.y));
            Store<T>::pair(dst + 2, saturate<T>(o.z), saturate<T>(o.w));
            if (c == 0) p.lse[row] = l;
        };
        if constexpr (TWO_LEVEL) {
            // The cluster's merged part goes to global memory as part `split / ranks` of the
            // row group's, and the last of the blocks of this rank in those clusters merges
            // their parts of the rank's rows.
            const int ranks = cluster_blocks(), rank = cluster_rank(), groups = int(p.splits) / ranks;
            const index_t group_row0 = index_t(split / ranks) * total_rows + out_row0;
            merge_cluster_parts<HEAD_DIM, Tiles::MAX_CLUSTER, true>(
                rows, dv, smem_address(s_part), smem_address(s_part_lse), [&](int r, int c, float4 o, float l) {
                    *reinterpret_cast<float4*>(p.part_out + (group_row0 + r) * dv + c) = o;
                    if (c == 0) p.part_lse[group_row0 + r] = l;
                });
            if (rank >= rows) return;   // (no rows here, nor in this rank's blocks of the other clusters)
            if (!last_to_count(p.split_counts + (index_t(be) * gridDim.z + blockIdx.z) * ranks + rank, groups))
                return;
            for_cluster_chunks<HEAD_DIM, true>(rows, dv, rank, ranks, [&](int r, int c) {
                const index_t row = out_row0 + r;
                float4 o;
                const float l = merge_chunk<Tiles::GROUP_BATCH>(
                    groups, [&](int g) { return __ldcg(p.part_lse + g * total_rows + row); },
                    [&](int g) {
                        return __ldcg(reinterpret_cast<const float4*>(p.part_out + (g * total_rows + row) * dv + c));
                    }, o);
                store_out(row, c, o, l);
            });
        } else {
            merge_cluster_parts<HEAD_DIM, Tiles::MAX_CLUSTER, false>(
                rows, dv, smem_address(s_part), smem_address(s_part_lse),
                [&](int r, int c, float4 o, float l) { store_out(out_row0 + r, c, o, l); });
        }
        return;
    }

    // The last of the rows' splits to finish merges their partials.
    if (!last_to_count(p.split_counts + index_t(be) * gridDim.z + blockIdx.z, int(p.splits))) return;
    merge_rows_by_warp<T, HEAD_DIM, Tiles::WARPS>(
        int(p.splits), dv, out_row0, rows, [&](int s, index_t row) { return __ldcg(p.part_lse + s * total_rows + row); },
        [&](int s, index_t row) { return p.part_out + (s * total_rows + row) * dv; }, p.out, p.lse);
}

}  // namespace cuflash

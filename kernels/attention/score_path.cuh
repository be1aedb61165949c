// score_path.cuh: the one step from a raw score q.k to its probability, forward and
// backward, with the score modifiers. Every kernel takes it from here; mask.cuh alone says
// which keys a row sees.
//
// Modified scores stay in raw units, s' = mod(scale s) / scale, so the softmax's scale_log2
// applies to them as to plain scores (its negative-scale and large-logit forms unchanged):
//   softcap c:  s' = (c / scale) tanh(s scale / c)     (AttnParams: cap = c / scale, cap_inv = scale / c)
//   ALiBi a:    s' = s' - (a / scale) |i + off - j|    (AttnParams: slope_unit = 1 / scale)
//   bias b:     s' = s' + b[i, j] / scale               (FullScores)
// A sink z enters only the forward's row sums (finish), on every score path, so lse counts it
// and the backward's p = exp2(s' scale_log2 - lse2) holds as it is; dsinks is a row sum the
// host takes. A call with sinks alone thus runs the plain kernels.
// Dropout (FullScores) zeroes the forward's p after the row sums took it, and scales out by
// 1 / (1 - dropout_p) at the end; the backward makes the same mask again (dropout.cuh) for the
// dv product's p and for dp. The backward's ds is taken with respect to the raw score:
// softcap's factor 1 - tanh^2 comes from p itself (scale s' = ln p + lse, less the bias), so no
// second copy of the scores is kept; dbias, dS before softcap's factor, is written by the dq pass.
#pragma once

namespace cuflash {

constexpr float LOG2E = 1.4426950408889634f;

// The score paths, a kernel's template argument: plain scores compile to exactly the
// kernels without modifiers.
struct PlainScores {
    static constexpr bool MODIFIED = false;
    static constexpr bool FULL = false;
    static constexpr bool BIAS_DROPOUT = false;
    static constexpr bool USER = false;
    static constexpr bool GRADS = false;
};
// softcap and ALiBi, each off at run time (cap 0, no slopes)
struct ModifiedScores {
    static constexpr bool MODIFIED = true;
    static constexpr bool FULL = false;
    static constexpr bool BIAS_DROPOUT = false;
    static constexpr bool USER = false;
    static constexpr bool GRADS = false;
};
// softcap, ALiBi, a bias and dropout, each off at run time (the portable prefill kernels').
// FULL: the kernels keep each sequence's positions (q0, k0, nq, nk: a bias's and dropout's, and the
// user path's); BIAS_DROPOUT: their code for a bias and dropout is compiled in.
struct FullScores {
    static constexpr bool MODIFIED = true;
    static constexpr bool FULL = true;
    static constexpr bool BIAS_DROPOUT = true;
    static constexpr bool USER = false;
    static constexpr bool GRADS = false;
};
// FullScores' modifiers and a call's own score and mask functions: UserScores<BIAS_DROPOUT, GRADS>
// (kernels/user/user_scores.cuh), compiled after the functions, where USER; the bias's and
// dropout's code only where the call has either (it costs the compile a quarter of its time);
// GRADS: the dq pass adds the gradients of the arrays the score function reads (score_mod_grads).

// What a call's block mask (UserScores: cuflash.block_mask) says of a kernel's tile: no element
// allowed (the kernel skips the tile), some, or every one (no mask function evaluated there).
// PARTIAL on every other path.
enum class TileKind : int { EMPTY = 0, PARTIAL = 1, FULL = 2 };

// A loop's walk over the tiles of a call's block mask (ON: the user path). A warp looks up 32
// tiles at once, a lane each (kind_of(b): tile b's kind, EMPTY past the loop's last), and keeps
// their kinds as two ballots, so that most steps read no memory: a lookup per step, a dependent
// load before the step's own loads, ran the forward slower than evaluating the mask function at
// every element. The loops are uniform over the block, so every lane takes part. Off the user
// path it is empty and the loops look nothing up (behind `if constexpr`: code there at all,
// folded away or not, moved the other paths' instructions).
template <bool ON>
struct BlockWalk {};
template <>
struct BlockWalk<true> {
    int base = -64;   // the first of the 32 tiles looked up (none yet)
    u32 some = 0, all = 0;

    template <class KindOf>
    __device__ __forceinline__ void look_up(int b, const KindOf& kind_of) {
        base = b;
        const TileKind kind = kind_of(b + int(threadIdx.x % 32));
        some = __ballot_sync(0xffffffffu, kind != TileKind::EMPTY);
        all = __ballot_sync(0xffffffffu, kind == TileKind::FULL);
    }
    // tile b's kind
    template <class KindOf>
    __device__ __forceinline__ TileKind at(int b, const KindOf& kind_of) {
        if (unsigned(b - base) >= 32u) look_up(b, kind_of);
        const u32 bit = 1u << (b - base);
        return (all & bit) ? TileKind::FULL : ((some & bit) ? TileKind::PARTIAL : TileKind::EMPTY);
    }
};

// What a call's block mask says of the key blocks of one row of tiles, for a thread on its own
// (the Hopper forward's loader, which skips the empty ones as the computing warps do): the rows'
// blocks looked up once, then a load or two per key block. Off the user path every tile is
// PARTIAL, and nothing is looked up.
template <class Scores, bool ON = Scores::USER>
struct BlockRowKinds {
    __device__ __forceinline__ BlockRowKinds(const AttnParams&, const Work&, int, int) {}
    __device__ __forceinline__ TileKind at(int, int) const { return TileKind::PARTIAL; }
};
template <class Scores>
struct BlockRowKinds<Scores, true> {
    decltype(Scores::row(nullptr, 0u, 0ll, 0ll)) row;
    int k0, nk;
    // rows [m0, m_end) of work w's sequence (clipped to it; m0 inside)
    __device__ __forceinline__ BlockRowKinds(const AttnParams& p, const Work& w, int m0, int m_end)
        : row(Scores::row(p.user_args, w.entry, w.q0 + m0, w.q0 + min(m_end, w.nq))), k0(w.k0), nk(w.nk) {}
    // keys [n0, n_end) of the sequence (clipped to it; n0 inside), as ScorePath::tile says
    __device__ __forceinline__ TileKind at(int n0, int n_end) const {
        return TileKind(Scores::row_tile(row, k0 + n0, k0 + min(n_end, nk)));
    }
};

// fn(mt, nt, e) for each element e of each m16n8 C fragment (mt, nt) a thread holds, unrolled
template <int M_TILES, int N_TILES, class Fn>
__device__ __forceinline__ void for_each_element(Fn&& fn) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) fn(mt, nt, e);
}

// A warp's dropout mask over TILES 16 x 16 tiles of its 16 rows: 8 bits per thread and tile,
// bit 4h + 2jb + b for rows g + 8h, columns 8jb + 2t + b (dropout.cuh). NoDrop: no mask (the
// paths without dropout).
template <int TILES>
struct KeepMask {
    u32 bits[TILES];
    float scale;   // kept probabilities' factor, 1 / (1 - dropout_p)
    __device__ __forceinline__ bool kept(int nt, int e) const {
        return (bits[nt / 2] >> (4 * (e >> 1) + 2 * (nt & 1) + (e & 1))) & 1u;
    }
    // p as the dv product takes it: kept ones scaled, dropped ones 0
    __device__ __forceinline__ float operator()(int, int kt, int e, float x) const { return kept(kt, e) ? x * scale : 0.f; }
};
struct NoDrop {
    __device__ __forceinline__ bool kept(int, int) const { return true; }
    __device__ __forceinline__ float operator()(int, int, int, float x) const { return x; }
};

// The backward's factor of each score of a warp's 16 rows over S_TILES 8-wide tiles on the
// user path (ON): d(the score the softmax sees) / d(the raw score), score_mod's derivative
// times softcap's, taken in modify() where score_mod's input is at hand; 1 off it. INPUTS: also
// score_mod's input per score, for the gradients of the arrays it reads (the dq pass's, GRADS),
// which need it once ds is known.
template <bool ON_, int S_TILES, bool INPUTS_ = false>
struct ScoreFactors {
    static constexpr bool ON = false;
    static constexpr bool INPUTS = false;
    __device__ __forceinline__ float operator()(int, int) const { return 1.f; }
};
template <int S_TILES>
struct ScoreFactors<true, S_TILES, false> {
    static constexpr bool ON = true;
    static constexpr bool INPUTS = false;
    float d[S_TILES][4];
    __device__ __forceinline__ float operator()(int nt, int e) const { return d[nt][e]; }
};
template <int S_TILES>
struct ScoreFactors<true, S_TILES, true> : ScoreFactors<true, S_TILES, false> {
    static constexpr bool INPUTS = true;
    float in[S_TILES][4];
};

// lse in the log2 domain for p = exp2(scaled score - lse2); a row that sees no
// key (lse = -inf) or lies past nq gets +inf, so its p is 0.
__device__ __forceinline__ float lse_to_log2(float l) { return l == -CUFLASH_INF ? CUFLASH_INF : l * LOG2E; }
__device__ __forceinline__ float lse_log2(const float* lse, int row, int nq) {
    return lse_to_log2(row < nq ? lse[row] : -CUFLASH_INF);
}

// p from a raw score, rounded once in the exponent. MASKED: s is -inf where
// the band excludes the key, and p must be 0 there whatever the scale's sign.
template <class T, bool MASKED>
__device__ __forceinline__ float probability(float s, float scale_log2, float lse2) {
    const float p = exp2_p<T>(fmaf(s, scale_log2, -lse2));
    return MASKED && s == -CUFLASH_INF ? 0.f : p;
}

// tanh and log2: the hardware's one-instruction forms for 16-bit inputs (2^-11 relative,
// below the inputs' rounding), the library's for float32 inputs.
template <class T>
__device__ __forceinline__ float tanh_of(float x) {
    if constexpr (T::SPLIT_SCALE) {
        return tanhf(x);
    } else {
        float y;
        asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
}
template <class T>
__device__ __forceinline__ float log2_of(float x) {
    if constexpr (T::SPLIT_SCALE) {
        return log2f(x);
    } else {
        float y;
        asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
}

// The parameters it reads stay in the constant bank (read at each use); it holds only the
// row's ALiBi slope and the band's offset in registers.
// Params: AttnParams, or the decoding kernel's DecodeParams (the same modifier fields).
// BIAS: whether the kernel may see a bias (BIAS_DROPOUT, not packed: a bias never comes with
// packed sequences, and its code beside theirs spilled).
template <class T, class Scores, class Params = AttnParams, bool BIAS = Scores::BIAS_DROPOUT>
struct ScorePath {
    static constexpr bool MODIFIED = Scores::MODIFIED;
    static constexpr bool FULL = Scores::FULL;
    static constexpr bool BIAS_DROPOUT = Scores::BIAS_DROPOUT;
    const Params& p;
    float slope = 0.f;   // ALiBi's slope in raw units (AttnParams: slope_unit); 0: none
    int off = 0;
    // FULL: the entry (dropout's n) and its bias's offset; the sequence's first row and key
    // in the arrays (dropout's positions) and its rows and keys (the bias's bounds)
    u32 entry = 0;
    index_t bias_base = 0;
    int q0 = 0, k0 = 0, nq = 0, nk = 0;

    // The path of query batch entry `entry` (the flat index of the broadcast batch).
    __device__ __forceinline__ ScorePath(const Params& p, const Band& band, u32 entry) : p(p) {
        if constexpr (MODIFIED) {
            slope = slope_of(entry);
            off = band.off;
        }
    }
    // The same, for the sequence of work w (FULL: a bias and dropout read where it lies).
    __device__ __forceinline__ ScorePath(const Params& p, const Band& band, u32 entry, const Work& w)
        : ScorePath(p, band, entry) {
        if constexpr (FULL) {
            this->entry = entry;
            if constexpr (BIAS) bias_base = p.bias ? p.bias_offset(entry) : 0;
            q0 = w.q0;
            k0 = w.k0;
            nq = w.nq;
            nk = w.nk;
        }
    }
    // The path of rows of several entries (the decoding kernel's), each its own: modify_rows,
    // slope_of and sink2_of.
    __device__ __forceinline__ explicit ScorePath(const Params& p) : p(p) {}

    __device__ __forceinline__ float slope_of(u32 e) const {
        return MODIFIED && p.alibi_slopes ? p.alibi_slopes[e] * p.slope_unit : 0.f;
    }
    // The sink's logit * log2(e) for OnlineSoftmax::finish; -inf: none.
    __device__ __forceinline__ float sink2_of(u32 e) const { return p.sinks ? p.sinks[e] * LOG2E : -CUFLASH_INF; }

    // softmax.finish (APPROX as there) with the sink of query entry `entry` where the call
    // has sinks: a branch per block, after its last key.
    template <bool APPROX, class Softmax, class Acc, class Lse>
    __device__ __forceinline__ void finish(Softmax& softmax, Acc& acc, Lse& lse, float scale_log2, u32 entry) const {
        if (p.sinks) {
            softmax.template finish<APPROX, true>(acc, lse, scale_log2, sink2_of(entry));
        } else {
            softmax.template finish<APPROX>(acc, lse, scale_log2);
        }
        if constexpr (BIAS_DROPOUT) {
            if (p.dropout_threshold) scale_by(acc, p.dropout_scale);
        }
    }

    // Whether the call has a bias (FULL); then every block takes the masked softmax, since a
    // bias may hold -inf anywhere (and so may a score or mask function's scores: USER).
    __device__ __forceinline__ bool biased() const {
        if constexpr (BIAS_DROPOUT && BIAS) {
            return p.bias != nullptr;
        } else {
            return false;
        }
    }
    __device__ __forceinline__ bool masks_anywhere() const { return Scores::USER || biased(); }

    __device__ __forceinline__ bool capped() const { return MODIFIED && p.cap != 0.f; }

    // What the call's block mask says of rows [m0, m_end) and keys [n0, n_end) of the sequence
    // (clipped to it; m0 and n0 inside)
    __device__ __forceinline__ TileKind tile(int m0, int m_end, int n0, int n_end) const {
        if constexpr (Scores::USER) {
            return TileKind(
                Scores::tile(p.user_args, entry, q0 + m0, q0 + min(m_end, nq), k0 + n0, k0 + min(n_end, nk)));
        } else {
            return TileKind::PARTIAL;
        }
    }
    // Raw scores to the scores the softmax sees, in place (before the mask). Fragments as
    // in apply_band: row0/col0 locate the warp's first element; KEYS_IN_ROWS: transposed.
    // softcap switched off is skipped (a uniform branch per tile); ALiBi's term with slope 0 is
    // two adds and an FMA per score (skipping it too spilled the portable D 96 dq pass).
    // `tile`: the block mask's word on the tile (FULL: the mask function is not evaluated).
    template <bool KEYS_IN_ROWS = false, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify(Score (&s)[M_TILES][N_TILES][4], int row0, int col0,
                                           TileKind tile = TileKind::PARTIAL) const {
        ScoreFactors<false, N_TILES> none;
        modify<KEYS_IN_ROWS>(s, row0, col0, tile, none);
    }
    // The same, taking the backward's factors where they are ON (one 16-row tile: M_TILES 1):
    // softcap's 1 - tanh^2 from the raw scores here, as p no longer tells the capped score.
    template <bool KEYS_IN_ROWS, class Score, int M_TILES, int N_TILES, class Factors>
    __device__ __forceinline__ void modify(Score (&s)[M_TILES][N_TILES][4], int row0, int col0, TileKind tile,
                                           Factors& f) const {
        if constexpr (Factors::ON) {
            static_assert(M_TILES == 1, "the backward's factors cover one 16-row tile");
            const bool cap = capped();
            for_each_element<1, N_TILES>([&](int, int nt, int e) {
                const float th = cap ? tanh_of<T>(float(s[0][nt][e]) * p.cap_inv) : 0.f;
                f.d[nt][e] = fmaf(-th, th, 1.f);
            });
        }
        cap_and_alibi<KEYS_IN_ROWS>(s, row0, col0);
        if (biased()) add_bias<KEYS_IN_ROWS>(s, row0, col0);
        if constexpr (Scores::USER) apply_user<KEYS_IN_ROWS>(s, row0, col0, tile, f);
    }
    // modify() with the bias from the block's tile in shared memory (`staged_bias`): Tile's
    // layout at s_tile, the warp's rows from tile_row0 of it, the block's keys from its first
    template <class Tile, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify_staged(Score (&s)[M_TILES][N_TILES][4], int row0, int col0, u32 s_tile,
                                                  int tile_row0, TileKind tile = TileKind::PARTIAL) const {
        cap_and_alibi<false>(s, row0, col0);
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
                    const u32 at = s_tile + Tile::offset(tile_row0 + mt * 16 + g + 8 * h, nt * 8 + 2 * t);
                    float b0, b1;
                    if constexpr (sizeof(typename T::storage) == 4) {
                        const float2 pair = lds_float2(at);
                        b0 = pair.x;
                        b1 = pair.y;
                    } else {
                        const u32 pair = __float_as_uint(lds_float(at));
                        b0 = Load<T>::bits(u16(pair & 0xFFFFu));
                        b1 = Load<T>::bits(u16(pair >> 16));
                    }
                    s[mt][nt][2 * h] += Score(b0 * p.slope_unit);
                    s[mt][nt][2 * h + 1] += Score(b1 * p.slope_unit);
                }
        if constexpr (Scores::USER) {
            ScoreFactors<false, N_TILES> none;
            apply_user<false>(s, row0, col0, tile, none);
        }
    }
    // softcap and ALiBi (MODIFIED), the steps before the bias; on the user path skipped where the
    // call has neither (a uniform branch: most calls with their own functions)
    template <bool KEYS_IN_ROWS, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void cap_and_alibi(Score (&s)[M_TILES][N_TILES][4], int row0, int col0) const {
        if constexpr (Scores::USER) {
            if (!capped() && slope == 0.f) return;
        }
        if constexpr (MODIFIED) {
            if (capped()) {
                modify_all<KEYS_IN_ROWS, true>(s, row0, col0);
            } else {
                modify_all<KEYS_IN_ROWS, false>(s, row0, col0);
            }
        }
    }

    // Whether the bias can come through shared memory, copied with the K/V blocks (the
    // portable forward's STAGED_BIAS): in T's storage type, its keys contiguous, and its rows on
    // 16-byte boundaries and whole 16-byte chunks, so that no copy reads past a row's last key.
    __device__ __forceinline__ bool staged_bias() const {
        using Storage = typename T::storage;
        constexpr index_t CHUNK = 16 / index_t(sizeof(Storage));
        return biased() && bool(p.bias_float32) == (sizeof(Storage) == 4) && p.bias_col_stride == 1 &&
               ((bias_base | p.bias_row_stride | index_t(nk)) & (CHUNK - 1)) == 0 &&
               (reinterpret_cast<size_t>(p.bias) & 15) == 0;
    }
    // The bias of row `row` of the sequence, from its first key (staged_bias)
    __device__ __forceinline__ const typename T::storage* bias_row(int row) const {
        return static_cast<const typename T::storage*>(p.bias) + bias_base + index_t(row) * p.bias_row_stride;
    }

    // The sequence's row and key of fragment element (mt, nt, e) of a warp's tile from row0, col0
    // (KEYS_IN_ROWS: keys in the tile's rows)
    template <bool KEYS_IN_ROWS>
    __device__ __forceinline__ static void position_of(int row0, int col0, int mt, int nt, int e, int& i, int& j) {
        const int row = row0 + mt * 16 + (threadIdx.x % 32) / 4 + 8 * (e >> 1);
        const int col = col0 + nt * 8 + 2 * (threadIdx.x % 4) + (e & 1);
        i = KEYS_IN_ROWS ? col : row;
        j = KEYS_IN_ROWS ? row : col;
    }

    // The call's score function on each score (in scaled units, as it takes them) and its mask
    // function (-inf where it refuses the key), at the positions in the arrays: the sequence's
    // first row and key plus its own (the reference's positions for packed sequences). Factors
    // ON: each factor times the score function's derivative there, 0 past the sequence's rows
    // and keys (whose p is 0, but whose derivative may not be finite). A FULL tile skips the
    // mask function (a uniform branch per tile).
    // Without a score function the scores pass as they are, and (the forward) a FULL tile is
    // left alone.
    template <bool KEYS_IN_ROWS, class Score, int M_TILES, int N_TILES, class Factors>
    __device__ __forceinline__ void apply_user(Score (&s)[M_TILES][N_TILES][4], int row0, int col0, TileKind tile,
                                               Factors& f) const {
        const float scale = 1.f / p.slope_unit;
        const bool test = Scores::MASK && tile != TileKind::FULL;
        if constexpr (!Scores::SCORE && !Factors::ON) {
            if (!test) return;
        }
        for_each_element<M_TILES, N_TILES>([&](int mt, int nt, int e) {
            int i, j;
            position_of<KEYS_IN_ROWS>(row0, col0, mt, nt, e, i, j);
            const long long qi = q0 + i, kj = k0 + j;
            const float in = float(s[mt][nt][e]) * scale;
            if constexpr (Factors::ON) {
                f.d[nt][e] = i < nq && j < nk ? f.d[nt][e] * Scores::dscore(in, entry, qi, kj, p.user_args) : 0.f;
            }
            if constexpr (Factors::INPUTS) f.in[nt][e] = in;
            user_step(s[mt][nt][e], in, entry, qi, kj, test);
        });
    }
    // The call's functions at one score, `in` in scaled units (as they take it), of row qi and
    // key kj of entry `entry`: s becomes the score function's result in raw units, or -inf where
    // the mask function (`test`) refuses the key; without a score function s stays as it is.
    template <class Score>
    __device__ __forceinline__ void user_step(Score& s, float in, u32 entry, long long qi, long long kj,
                                              bool test) const {
        const bool kept = !test || Scores::allowed(entry, qi, kj, p.user_args);
        if constexpr (Scores::SCORE) {
            const float x = Scores::score(in, entry, qi, kj, p.user_args);
            s = Score(kept ? x * p.slope_unit : -CUFLASH_INF);
        } else if (!kept) {
            s = Score(-CUFLASH_INF);
        }
    }

    // Whether the bias's key pairs (2t, 2t + 1) are aligned neighbours, one load each (taken
    // per block: a register kept for it spilled packed kernels, which never see a bias)
    __device__ __forceinline__ bool bias_pairs() const {
        return p.bias_col_stride == 1 && ((bias_base | p.bias_row_stride) & 1) == 0 &&
               (reinterpret_cast<size_t>(p.bias) & (p.bias_float32 ? 7 : 3)) == 0;
    }
    // The bias of row i and key j of the sequence, in raw units; 0 past its rows and keys.
    __device__ __forceinline__ float bias_at(int i, int j) const {
        if (i >= nq || j >= nk) return 0.f;
        const index_t at = bias_base + index_t(i) * p.bias_row_stride + index_t(j) * p.bias_col_stride;
        const float b = p.bias_float32 ? static_cast<const float*>(p.bias)[at]
                                       : Load<T>::one(static_cast<const typename T::storage*>(p.bias) + at);
        return b * p.slope_unit;
    }
    // The bias of fragment element (mt, nt, e) of a warp's tile from row0, col0
    template <bool KEYS_IN_ROWS>
    __device__ __forceinline__ float bias_of(int row0, int col0, int mt, int nt, int e) const {
        int i, j;
        position_of<KEYS_IN_ROWS>(row0, col0, mt, nt, e, i, j);
        return bias_at(i, j);
    }
    template <bool KEYS_IN_ROWS, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void add_bias(Score (&s)[M_TILES][N_TILES][4], int row0, int col0) const {
        // keys along rows, every one of the warp's inside the sequence: a load per key pair
        if constexpr (!KEYS_IN_ROWS) {
            if (bias_pairs() && col0 + N_TILES * 8 <= nk) {
                if (p.bias_float32) {
                    add_bias_pairs<float>(s, row0, col0);
                } else {
                    add_bias_pairs<typename T::storage>(s, row0, col0);
                }
                return;
            }
        }
        for_each_element<M_TILES, N_TILES>(
            [&](int mt, int nt, int e) { s[mt][nt][e] += Score(bias_of<KEYS_IN_ROWS>(row0, col0, mt, nt, e)); });
    }

    // add_bias with the bias's elements of type E (float, or T's storage) read in pairs: row by
    // row, the thread's keys 2t and 2t + 1 of each 8-wide tile from col0 (rows past nq take none).
    template <class E, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void add_bias_pairs(Score (&s)[M_TILES][N_TILES][4], int row0, int col0) const {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + mt * 16 + g + 8 * h;
                if (row >= nq) continue;
                const E* at = static_cast<const E*>(p.bias) + bias_base + index_t(row) * p.bias_row_stride + col0 + 2 * t;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
                    float b0, b1;
                    if constexpr (sizeof(E) == 4) {
                        const float2 pair = *reinterpret_cast<const float2*>(at + nt * 8);
                        b0 = pair.x;
                        b1 = pair.y;
                    } else {
                        const u32 pair = *reinterpret_cast<const u32*>(at + nt * 8);
                        b0 = Load<T>::bits(u16(pair & 0xFFFFu));
                        b1 = Load<T>::bits(u16(pair >> 16));
                    }
                    s[mt][nt][2 * h] += Score(b0 * p.slope_unit);
                    s[mt][nt][2 * h + 1] += Score(b1 * p.slope_unit);
                }
            }
    }

    // Dropout's mask of the 16 x 16 tile at sequence positions row0, col0 (KEYS_IN_ROWS: keys in
    // rows): one Philox call per thread (two with keys in rows) where the tile starts at
    // multiples of 16 in the arrays, else one per element (packed sequences).
    template <bool KEYS_IN_ROWS>
    __device__ __forceinline__ u32 keep_bits(int row0, int col0) const {
        const Dropout d{u32(p.dropout_seed), u32(p.dropout_seed >> 32), p.dropout_threshold, p.dropout_scale};
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
        const long long r0 = (KEYS_IN_ROWS ? k0 : q0) + row0, c0 = (KEYS_IN_ROWS ? q0 : k0) + col0;
        if (((r0 | c0) & 15) == 0) {
            return KEYS_IN_ROWS ? d.keep_tile_transposed(entry, c0, r0, g, t) : d.keep_tile(entry, r0, c0, g, t);
        }
        u32 kept = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int jb = 0; jb < 2; ++jb)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const long long r = r0 + g + 8 * h, c = c0 + 8 * jb + 2 * t + b;
                    kept |= u32(KEYS_IN_ROWS ? d.keep(entry, c, r) : d.keep(entry, r, c)) << (4 * h + 2 * jb + b);
                }
        return kept;
    }
    // The mask of a warp's 16 rows from row0 over S_TILES 8-wide tiles from col0 (all kept
    // without dropout); NoDrop where dropout is not compiled in (BIAS_DROPOUT).
    template <bool KEYS_IN_ROWS, int S_TILES>
    __device__ __forceinline__ auto keep_mask(int row0, int col0) const {
        if constexpr (BIAS_DROPOUT) {
            KeepMask<S_TILES / 2> mask;
            mask.scale = p.dropout_scale;
#pragma unroll
            for (int i = 0; i < S_TILES / 2; ++i) {
                mask.bits[i] = p.dropout_threshold ? keep_bits<KEYS_IN_ROWS>(row0, col0 + 16 * i) : 0xFFu;
            }
            return mask;
        } else {
            return NoDrop{};
        }
    }
    // The forward's dropout on p in place, after the row sums took it: dropped ones 0 (out is
    // scaled by 1 / (1 - dropout_p) in finish). Rows from row0, keys from col0.
    template <class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void drop(Score (&s)[M_TILES][N_TILES][4], int row0, int col0) const {
        if constexpr (BIAS_DROPOUT) {
            if (p.dropout_threshold) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                    for (int i = 0; i < N_TILES / 2; ++i) {
                        const u32 kept = keep_bits<false>(row0 + 16 * mt, col0 + 16 * i);
#pragma unroll
                        for (int jb = 0; jb < 2; ++jb)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                if (!((kept >> (4 * (e >> 1) + 2 * jb + (e & 1))) & 1u)) s[mt][2 * i + jb][e] = Score(0);
                            }
                    }
            }
        }
    }

    template <bool KEYS_IN_ROWS, bool CAP, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify_all(Score (&s)[M_TILES][N_TILES][4], int row0, int col0) const {
        const float first = first_offset<KEYS_IN_ROWS>(row0, col0);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = softcapped<CAP>(float(s[mt][nt][e]));
                    const float d = distance<KEYS_IN_ROWS>(first, mt * 16 + 8 * (e >> 1), nt * 8 + (e & 1));
                    s[mt][nt][e] = Score(fmaf(-slope, d, x));
                }
    }

    // modify() for rows of several entries (the decoding kernel's: query heads of one K/V
    // head), rows not transposed: the thread's row (mt, h) with its slope slopes[mt][h], its
    // query's position against the keys, i + off, at[mt][h], and (USER) its flat query entry
    // entries[mt][h], whose functions see at[mt][h] as q_idx; keys from col0. Every element
    // takes the mask function (the cache has no block mask).
    template <class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify_rows(Score (&s)[M_TILES][N_TILES][4], const float (&slopes)[M_TILES][2],
                                                const int (&at)[M_TILES][2], const u32 (&entries)[M_TILES][2],
                                                int col0) const {
        if constexpr (MODIFIED) {
            if (capped()) {
                modify_rows_all<true>(s, slopes, at, col0);
            } else {
                modify_rows_all<false>(s, slopes, at, col0);
            }
        }
        if constexpr (Scores::USER) {
            const float scale = 1.f / p.slope_unit;
            const int t = threadIdx.x % 4;
            for_each_element<M_TILES, N_TILES>([&](int mt, int nt, int e) {
                const int h = e >> 1;
                user_step(s[mt][nt][e], float(s[mt][nt][e]) * scale, entries[mt][h], at[mt][h],
                          col0 + nt * 8 + 2 * t + (e & 1), Scores::MASK);
            });
        }
    }

    template <bool CAP, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify_rows_all(Score (&s)[M_TILES][N_TILES][4], const float (&slopes)[M_TILES][2],
                                                    const int (&at)[M_TILES][2], int col0) const {
        const int t = threadIdx.x % 4;
        float first[M_TILES][2];   // i + off - j at the thread's first key, 2t from col0
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) first[mt][h] = float(at[mt][h] - col0 - 2 * t);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = softcapped<CAP>(float(s[mt][nt][e]));
                    const float d = distance<false>(first[mt][e >> 1], 0, nt * 8 + (e & 1));
                    s[mt][nt][e] = Score(fmaf(-slopes[mt][e >> 1], d, x));
                }
    }

    // A raw score softcapped (CAP), before ALiBi's term
    template <bool CAP>
    __device__ __forceinline__ float softcapped(float x) const {
        return CAP ? p.cap * tanh_of<T>(x * p.cap_inv) : x;
    }

    // i + off - j of query i and key j at the thread's first fragment element (row0 + g,
    // col0 + 2t), as a float: the others differ from it by constants, so a distance costs
    // no conversion per score (exact below 2^24 positions).
    template <bool KEYS_IN_ROWS>
    __device__ __forceinline__ float first_offset(int row0, int col0) const {
        const int row = row0 + (threadIdx.x % 32) / 4, col = col0 + 2 * (threadIdx.x % 4);
        return float(KEYS_IN_ROWS ? col + off - row : row + off - col);
    }
    // |i + off - j| of the element `rows` rows and `cols` columns past the first
    template <bool KEYS_IN_ROWS>
    __device__ __forceinline__ static float distance(float first, int rows, int cols) {
        return fabsf(first + float(KEYS_IN_ROWS ? cols - rows : rows - cols));
    }

    // p times the derivative of the modified score by the raw one (CAP: 1 - tanh^2, with
    // tanh from p: scale s' = ln p + lse, plus ALiBi's term back, `dist` its distance); 0
    // where p is.
    template <bool CAP>
    __device__ __forceinline__ float chained(float prob, float lse2, float dist, float bias = 0.f) const {
        if constexpr (!CAP) {
            return prob;
        } else {
            const float capped_score = fmaf(fmaxf(log2_of<T>(prob), -150.f) + lse2, p.unscale, slope * dist) - bias;
            const float th = capped_score * p.cap_inv;
            return prob > 0.f ? prob * fmaf(-th, th, 1.f) : 0.f;
        }
    }

    // p^T from s^T in place, 0 where masked: rows are keys (the warp's from key_row0 of
    // [n0, n_end)), columns queries of [m0, m_end) with their lse2 from shared memory
    // (RAW: lse as stored); and the factors of ds (ScoreFactors), where ON.
    template <bool RAW = false, int S_TILES>
    __device__ __forceinline__ void transposed_probabilities(float (&st)[1][S_TILES][4], const Band& band, int m0,
                                                             int m_end, int n0, int n_end, int key_row0,
                                                             float scale_log2, const float* lse2) const {
        ScoreFactors<false, S_TILES> none;
        transposed_probabilities<RAW>(st, band, m0, m_end, n0, n_end, key_row0, scale_log2, lse2, none);
    }
    template <bool RAW = false, int S_TILES, class Factors>
    __device__ __forceinline__ void transposed_probabilities(float (&st)[1][S_TILES][4], const Band& band, int m0,
                                                             int m_end, int n0, int n_end, int key_row0,
                                                             float scale_log2, const float* lse2, Factors& f,
                                                             TileKind tile = TileKind::PARTIAL) const {
        modify<true>(st, key_row0, m0, tile, f);
        if (masks_anywhere() || band.cuts(m0, m_end, n0, n_end)) {
            apply_band<true>(st, band, key_row0, m0);
            by_col<true, RAW>(st, scale_log2, lse2);
        } else {
            by_col<false, RAW>(st, scale_log2, lse2);
        }
    }

    // p from s in place, 0 where masked: rows are queries (the warp's from row0 of
    // [m0, m_end), the thread's two lse2 in registers), columns keys of [n0, n_end).
    template <int S_TILES>
    __device__ __forceinline__ void row_probabilities(float (&s)[1][S_TILES][4], const Band& band, int m0, int m_end,
                                                      int n0, int n_end, int row0, float scale_log2,
                                                      const float (&lse2)[2]) const {
        ScoreFactors<false, S_TILES> none;
        row_probabilities(s, band, m0, m_end, n0, n_end, row0, scale_log2, lse2, none);
    }
    template <int S_TILES, class Factors>
    __device__ __forceinline__ void row_probabilities(float (&s)[1][S_TILES][4], const Band& band, int m0, int m_end,
                                                      int n0, int n_end, int row0, float scale_log2,
                                                      const float (&lse2)[2], Factors& f,
                                                      TileKind tile = TileKind::PARTIAL) const {
        modify<false>(s, row0, n0, tile, f);
        if (masks_anywhere() || band.cuts(m0, m_end, n0, n_end)) {
            apply_band(s, band, row0, n0);
            by_row<true>(s, scale_log2, lse2);
        } else {
            by_row<false>(s, scale_log2, lse2);
        }
    }

    template <bool MASKED, bool RAW, int S_TILES>
    __device__ __forceinline__ static void by_col(float (&s)[1][S_TILES][4], float scale_log2, const float* lse2) {
        const int t = threadIdx.x % 4;
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float l = lse2[nt * 8 + 2 * t + (e & 1)];
                s[0][nt][e] = probability<T, MASKED>(s[0][nt][e], scale_log2, RAW ? lse_to_log2(l) : l);
            }
    }
    template <bool MASKED, int S_TILES>
    __device__ __forceinline__ static void by_row(float (&s)[1][S_TILES][4], float scale_log2, const float (&lse2)[2]) {
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][nt][e] = probability<T, MASKED>(s[0][nt][e], scale_log2, lse2[e >> 1]);
    }

    // ds = p' (dp - delta) in dp's registers, p' = chained(p). transposed_ds: rows are keys
    // from key_row0, each query column's delta and lse2 (RAW: lse) from shared memory (or
    // taken from there per fragment element), from m0; row_ds: rows are queries from row0,
    // the thread's two deltas and lse2, keys from n0.
    // mask: dropout's (keep_mask), applied to dp; none by default. f: the factors of the
    // probabilities' pass (ScoreFactors), where ON in place of chained()'s.
    template <bool RAW = false, int S_TILES, class Mask = NoDrop, class Factors = ScoreFactors<false, S_TILES>>
    __device__ __forceinline__ void transposed_ds(float (&dpt)[1][S_TILES][4], const float (&pt)[1][S_TILES][4],
                                                  const float* delta, const float* lse2, int key_row0, int m0,
                                                  const Mask& mask = {}, const Factors& f = {}) const {
        const int t = threadIdx.x % 4;
        ds_by<true, RAW>(dpt, pt, [&](int nt, int e) { return delta[nt * 8 + 2 * t + (e & 1)]; },
                         [&](int nt, int e) { return lse2[nt * 8 + 2 * t + (e & 1)]; }, key_row0, m0, mask, f);
    }
    template <int S_TILES>
    __device__ __forceinline__ void transposed_ds(float (&dpt)[1][S_TILES][4], const float (&pt)[1][S_TILES][4],
                                                  const float (&delta)[1][S_TILES][4],
                                                  const float (&lse2)[1][S_TILES][4], int key_row0, int m0) const {
        ds_by<true, false>(dpt, pt, [&](int nt, int e) { return delta[0][nt][e]; },
                           [&](int nt, int e) { return lse2[0][nt][e]; }, key_row0, m0, NoDrop{},
                           ScoreFactors<false, S_TILES>{});
    }
    template <int S_TILES, class Mask = NoDrop, class Factors = ScoreFactors<false, S_TILES>>
    __device__ __forceinline__ void row_ds(float (&dp)[1][S_TILES][4], const float (&p)[1][S_TILES][4],
                                           const float (&delta)[2], const float (&lse2)[2], int row0, int n0,
                                           const Mask& mask = {}, const Factors& f = {}) const {
        ds_by<false, false>(dp, p, [&](int, int e) { return delta[e >> 1]; }, [&](int, int e) { return lse2[e >> 1]; },
                            row0, n0, mask, f);
    }

    // The dq pass's ds = p (dp - delta) in place of dp, dp through dropout's mask (row_ds), after
    // its dbias where the call asks for it (BIAS_DROPOUT: the backward's parameters `bp`, whose
    // dbias holds query entry `entry`'s nq x nk rows, or is null) and the gradients of the
    // arrays the score function reads (Factors::INPUTS: the call's score_mod_grads)
    template <int S_TILES, class BwdP, class Factors>
    __device__ __forceinline__ void dq_ds(float (&dp)[1][S_TILES][4], const float (&prob)[1][S_TILES][4],
                                          const float (&delta)[2], const float (&lse2)[2], int row0, int n0,
                                          const BwdP& bp, u32 entry, const Factors& f) const {
        const auto kept = keep_mask<false, S_TILES>(row0, n0);
        if constexpr (BIAS_DROPOUT) {
            if (bp.dbias) store_dbias(bp.dbias + index_t(entry) * bp.nq * bp.nk, dp, prob, delta, row0, n0, kept, f);
        }
        if constexpr (Factors::INPUTS) {
            // dS with respect to the score function's result first, then its factor (so that p
            // and dp are no longer held beside the inputs while the gradients are added)
            for_each_element<1, S_TILES>([&](int, int nt, int e) {
                dp[0][nt][e] = prob[0][nt][e] * (kept(0, nt, e, dp[0][nt][e]) - delta[e >> 1]);
            });
            add_score_grads(dp, row0, n0, f);
            for_each_element<1, S_TILES>([&](int, int nt, int e) { dp[0][nt][e] *= f(nt, e); });
        } else {
            row_ds(dp, prob, delta, lse2, row0, n0, kept, f);
        }
    }

    // The gradients of the arrays the score function reads: each score's dS (`ds`, with respect
    // to the score function's result) times the derivative of each read there, added at the
    // element read (UserScores::score_grads, atomically). A score whose dS is 0 (its key
    // refused, its p 0) adds nothing.
    template <int S_TILES, class Factors>
    __device__ __forceinline__ void add_score_grads(const float (&ds)[1][S_TILES][4], int row0, int col0,
                                                    const Factors& f) const {
        for_each_element<1, S_TILES>([&](int, int nt, int e) {
            int i, j;
            position_of<false>(row0, col0, 0, nt, e, i, j);
            if (i < nq && j < nk && ds[0][nt][e] != 0.f) {
                Scores::score_grads(f.in[nt][e], ds[0][nt][e], entry, q0 + i, k0 + j, p.user_args);
            }
        });
    }

    // The dq pass's dbias (BIAS_DROPOUT): dS = p (dp' - delta) before softcap's factor, dp' dp through
    // dropout's mask, for the warp's rows from row0 and keys from col0 of the sequence, into
    // `dbias`, the entry's nq x nk float32 rows; times the factors f, where ON (the user path's,
    // where the call has no softcap: score_mod's derivative).
    template <int S_TILES, class Mask, class Factors = ScoreFactors<false, S_TILES>>
    __device__ __forceinline__ void store_dbias(float* dbias, const float (&dp)[1][S_TILES][4],
                                                const float (&prob)[1][S_TILES][4], const float (&delta)[2], int row0,
                                                int col0, const Mask& mask, const Factors& f = {}) const {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + g + 8 * (e >> 1), col = col0 + nt * 8 + 2 * t + (e & 1);
                if (row < nq && col < nk) {
                    dbias[index_t(row) * nk + col] =
                        prob[0][nt][e] * f(nt, e) * (mask(0, nt, e, dp[0][nt][e]) - delta[e >> 1]);
                }
            }
    }

    template <bool KEYS_IN_ROWS, bool RAW, int S_TILES, class Delta, class Lse2, class Mask, class Factors>
    __device__ __forceinline__ void ds_by(float (&dp)[1][S_TILES][4], const float (&p)[1][S_TILES][4], Delta delta,
                                          Lse2 lse2, int row0, int col0, const Mask& mask, const Factors& f) const {
        if (!Factors::ON && capped()) {
            // (row0 through an opaque move: ALiBi's distances are then recomputed here, where
            // the compiler would rather keep modify()'s through the products, in registers)
            int row0_here;
            asm("mov.b32 %0, %1;" : "=r"(row0_here) : "r"(row0));
            const float first = first_offset<KEYS_IN_ROWS>(row0_here, col0);
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float l = lse2(nt, e);
                    const float dist = distance<KEYS_IN_ROWS>(first, 8 * (e >> 1), nt * 8 + (e & 1));
                    const float bias = biased() ? bias_of<KEYS_IN_ROWS>(row0_here, col0, 0, nt, e) : 0.f;
                    dp[0][nt][e] = chained<true>(p[0][nt][e], RAW ? lse_to_log2(l) : l, dist, bias) *
                                   (mask(0, nt, e, dp[0][nt][e]) - delta(nt, e));
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    dp[0][nt][e] = p[0][nt][e] * f(nt, e) * (mask(0, nt, e, dp[0][nt][e]) - delta(nt, e));
                }
        }
    }
};

}  // namespace cuflash

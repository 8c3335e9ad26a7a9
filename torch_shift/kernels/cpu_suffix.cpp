// Suffix decoding's draft over one implicit suffix tree (torch_shift/engine/spec_decode/suffix.py, which holds the
// same rule in Python as the reference and the fallback): the tree's nodes are sets of end positions in a token
// array. The Python matcher cost 85 us a call on the edit and agent work, 10-25% of a step that checks proposed
// tokens on the default model (docs/performance.md); each set here is a list of positions and each count a sort.
//
// Entry point is extern "C" with raw pointers (called through ctypes), as cpu_attention.cpp's.

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "cpu_no_contract.h"  // scores compare exactly with the Python rule's

namespace {

constexpr int64_t PAD = -1;  // tokens.py: never a token id

struct Path {
  std::vector<int64_t> tokens;
  std::vector<double> scores;  // the path's score after each token (a sum of probabilities)
};

inline int64_t token_at(const int64_t* tokens, int64_t num_tokens, int64_t i) {
  return i >= 0 && i < num_tokens ? tokens[i] : PAD;
}

// suffix.py's grow_path: from the node whose occurrences end at `ends`, the most frequent next token each time (ties
// to the smallest id), its probability the product of count / occurrences (those followed by PAD counted too), until
// it falls below min_prob, nothing follows, or the path holds max_tokens tokens.
Path grow_path(const int64_t* tokens, int64_t num_tokens, std::vector<int64_t> ends, int64_t max_tokens,
               double min_prob) {
  Path path;
  double prob = 1.0;
  double score = 0.0;
  std::vector<int64_t> following;
  for (int64_t offset = 1; static_cast<int64_t>(path.tokens.size()) < max_tokens && !ends.empty(); ++offset) {
    following.clear();
    for (int64_t end : ends) {
      int64_t token = token_at(tokens, num_tokens, end + offset);
      if (token != PAD) following.push_back(token);
    }
    if (following.empty()) break;
    std::sort(following.begin(), following.end());
    int64_t best = following[0], best_count = 0;
    for (size_t i = 0; i < following.size();) {
      size_t j = i;
      while (j < following.size() && following[j] == following[i]) ++j;
      if (static_cast<int64_t>(j - i) > best_count) {  // strictly more: the first (smallest) of equal counts stays
        best = following[i];
        best_count = static_cast<int64_t>(j - i);
      }
      i = j;
    }
    prob *= static_cast<double>(best_count) / static_cast<double>(ends.size());
    if (prob < min_prob) break;
    score += prob;
    path.tokens.push_back(best);
    path.scores.push_back(score);
    size_t kept = 0;
    for (int64_t end : ends)
      if (token_at(tokens, num_tokens, end + offset) == best) ends[kept++] = end;
    ends.resize(kept);
  }
  return path;
}

// The global tree's index (suffix.py's GlobalTree, with these kernels): the end positions of every pair of adjacent
// tokens in its array. Read by the proposer on the engine's thread and by the C++ decoder, drafting a check's later
// stages (cpu_decoder.cpp's run_redrafting) on its own thread while the engine's may index new outputs: a shared
// mutex. Positions of evicted outputs stay (their tokens are PAD now: they match nothing) until the tree is compacted.
// Both libraries link this file (kernels/__init__.py): an index the proposer's library made is read by the decoder's
// library's copy of these functions, the same type built by the same compiler.
struct PairIndex {
  struct Hash {
    size_t operator()(const std::pair<int64_t, int64_t>& p) const {
      return std::hash<int64_t>()(p.first * 0x9E3779B97F4A7C15ull ^ p.second);
    }
  };
  std::shared_mutex mutex;
  std::unordered_map<std::pair<int64_t, int64_t>, std::vector<int64_t>, Hash> ends;
};

}  // namespace

extern "C" {

// The best draft over every matched length of the context's suffix in one tree (suffix.py's suffix_matches and
// best_draft). tokens[0, num_tokens): the tree's array (PAD between sequences; reads past it are PAD). The
// candidates: `ends` (num_ends of them), or, with ends null, every position below scan_len holding the context's
// last token. A candidate matches L tokens when the L tokens ending at it are the context's last L; lengths run
// from first_len while at least min_count candidates match them, up to context_len - 1. Writes the draft (at most
// max_spec_tokens tokens, each with the score after it) and its match length; returns its token count, or -1 for
// arguments out of range.
int64_t ts_suffix_draft(const int64_t* tokens, int64_t num_tokens, const int64_t* ends, int64_t num_ends,
                        int64_t scan_len, const int64_t* context, int64_t context_len, int64_t first_len,
                        int64_t min_count, int64_t max_depth, int64_t max_spec_tokens, double max_spec_factor,
                        double min_token_prob, double beat, int64_t* out_tokens, double* out_scores,
                        int64_t* out_match_len) {
  *out_match_len = 0;
  if (first_len < 1 || context_len < 1 || max_spec_tokens < 0 || scan_len > num_tokens) return -1;
  const int64_t max_len = context_len - 1;
  if (max_len < first_len) return 0;
  // each candidate's match length, capped at max_len
  std::vector<std::pair<int64_t, int64_t>> matched;  // (match length, end)
  auto consider = [&](int64_t end) {
    int64_t length = 0;
    while (length < max_len && token_at(tokens, num_tokens, end - length) == context[context_len - 1 - length])
      ++length;
    if (length >= first_len) matched.emplace_back(length, end);
  };
  if (ends != nullptr) {
    for (int64_t i = 0; i < num_ends; ++i) consider(ends[i]);
  } else {
    const int64_t last = context[context_len - 1];
    for (int64_t i = 0; i < scan_len; ++i)
      if (tokens[i] == last) consider(i);
  }
  // longest matches first: the candidates of length L are a prefix of this order
  std::sort(matched.begin(), matched.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<int64_t> counts;  // counts[L - first_len]: candidates matching at least L tokens
  for (int64_t length = first_len; length <= max_len; ++length) {
    auto it = std::partition_point(matched.begin(), matched.end(),
                                   [length](const auto& m) { return m.first >= length; });
    int64_t count = it - matched.begin();
    if (count < min_count || count == 0) break;
    counts.push_back(count);
  }
  // lengths in order of their path's limit, largest first (ties: the longer match)
  struct Length {
    int64_t limit, length, count;
  };
  std::vector<Length> lengths;
  for (size_t i = 0; i < counts.size(); ++i) {
    int64_t length = first_len + static_cast<int64_t>(i);
    int64_t limit = std::min({max_spec_tokens, static_cast<int64_t>(length * max_spec_factor + 1e-6),
                              max_depth - length});
    lengths.push_back({limit, length, counts[i]});
  }
  std::sort(lengths.begin(), lengths.end(), [](const Length& a, const Length& b) {
    return a.limit != b.limit ? a.limit > b.limit : a.length > b.length;
  });
  // nested sets: two lengths of one count are one node, its path walked once (for the larger limit) and cut
  std::vector<std::pair<int64_t, Path>> walked;
  double best_score = 0.0;
  int64_t best_tokens = 0;
  for (const Length& l : lengths) {
    double limit = static_cast<double>(l.limit);
    if (limit <= beat || limit < best_score || (limit == best_score && l.length < *out_match_len)) continue;
    const Path* path = nullptr;
    for (const auto& w : walked)
      if (w.first == l.count) path = &w.second;
    if (path == nullptr) {
      std::vector<int64_t> node;
      node.reserve(l.count);
      for (int64_t i = 0; i < l.count; ++i) node.push_back(matched[i].second);
      walked.emplace_back(l.count, grow_path(tokens, num_tokens, std::move(node), l.limit, min_token_prob));
      path = &walked.back().second;
    }
    int64_t num = std::min(std::max<int64_t>(l.limit, 0), static_cast<int64_t>(path->tokens.size()));
    double score = num ? path->scores[num - 1] : 0.0;
    if (score > best_score || (score == best_score && num > 0 && l.length > *out_match_len)) {
      best_score = score;
      best_tokens = num;
      *out_match_len = l.length;
      std::copy(path->tokens.begin(), path->tokens.begin() + num, out_tokens);
      std::copy(path->scores.begin(), path->scores.begin() + num, out_scores);
    }
  }
  return best_tokens;
}

void* ts_pair_index_new() { return new PairIndex(); }

void ts_pair_index_delete(void* index) { delete static_cast<PairIndex*>(index); }

// The pairs of tokens[start, end): each (tokens[i - 1], tokens[i]) at position i, for i from start + 1
void ts_pair_index_add(void* index, const int64_t* tokens, int64_t start, int64_t end) {
  PairIndex& x = *static_cast<PairIndex*>(index);
  std::unique_lock<std::shared_mutex> lock(x.mutex);
  for (int64_t i = start + 1; i < end; ++i) x.ends[{tokens[i - 1], tokens[i]}].push_back(i);
}

void ts_pair_index_clear(void* index) {
  PairIndex& x = *static_cast<PairIndex*>(index);
  std::unique_lock<std::shared_mutex> lock(x.mutex);
  x.ends.clear();
}

// ts_suffix_draft over the global tree (tokens[0, num_tokens), indexed by `index`): the candidates are the end
// positions of the context's last two tokens, matches from two tokens on, found once or more (suffix.py's
// SuffixProposer.speculate). Positions at or past num_tokens (the tree grew into a larger array since the caller
// read it) match nothing.
int64_t ts_suffix_draft_global(void* index, const int64_t* tokens, int64_t num_tokens, const int64_t* context,
                               int64_t context_len, int64_t max_depth, int64_t max_spec_tokens,
                               double max_spec_factor, double min_token_prob, double beat, int64_t* out_tokens,
                               double* out_scores, int64_t* out_match_len) {
  *out_match_len = 0;
  if (context_len < 3) return 0;
  PairIndex& x = *static_cast<PairIndex*>(index);
  std::shared_lock<std::shared_mutex> lock(x.mutex);
  const auto found = x.ends.find({context[context_len - 2], context[context_len - 1]});
  if (found == x.ends.end()) return 0;
  return ts_suffix_draft(tokens, num_tokens, found->second.data(), static_cast<int64_t>(found->second.size()), 0,
                         context, context_len, 2, 1, max_depth, max_spec_tokens, max_spec_factor, min_token_prob,
                         beat, out_tokens, out_scores, out_match_len);
}

}  // extern "C"

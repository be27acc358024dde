// What a dataloader state (datasets/sharding.h, version 2) says is still unread, as test code
// reads it — for token accounting tests that run the real `train` and open its checkpoints.
#pragma once
#include <cstdint>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace ctitan::testing {

// One unit of "work": [file, begin, end (-1: to the end), stride, phase, ordinal, chain].
struct StateUnit {
  int64_t file, begin, end, stride, phase, ordinal, chain;
};

inline std::vector<StateUnit> state_work(const std::string& state) {
  std::smatch m;
  std::vector<StateUnit> out;
  if (!std::regex_search(state, m, std::regex("\"work\":\\[(.*?)\\],\"buffer\""))) return out;
  const std::string w = m[1];
  std::vector<int64_t> v;
  const std::regex num("-?[0-9]+");
  for (auto it = std::sregex_iterator(w.begin(), w.end(), num); it != std::sregex_iterator(); ++it)
    v.push_back(std::stoll(it->str()));
  for (size_t i = 0; i + 7 <= v.size(); i += 7)
    out.push_back({v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4], v[i + 5], v[i + 6]});
  return out;
}

inline std::vector<int64_t> state_buffer(const std::string& state) {
  std::vector<int64_t> out;
  const auto at = state.find("\"buffer\":[");
  if (at == std::string::npos) return out;
  std::istringstream is(state.substr(at + 10));
  for (int64_t v; is >> v;) {
    out.push_back(v);
    if (is.peek() == ',') is.get();
  }
  return out;
}

// A document by its identity: file index, byte offset of its first line, index in its file,
// index in the corpus.
struct DocId {
  int64_t file = 0, offset = 0, index = 0, global = 0;
};

inline bool still_unread(const std::vector<StateUnit>& work, const DocId& d) {
  for (const StateUnit& u : work) {
    if (u.chain) {
      if ((d.file > u.file || (d.file == u.file && d.offset >= u.begin)) && d.global % u.stride == u.phase) return true;
      continue;
    }
    if (d.file == u.file && d.offset >= u.begin && (u.end < 0 || d.offset < u.end) && d.index % u.stride == u.phase)
      return true;
  }
  return false;
}

// The non-empty lines of a one-paragraph-per-line .txt file (paragraphs separated by blank
// lines), with their byte offsets: the documents of such a corpus, in order.
inline std::vector<DocId> line_documents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<DocId> out;
  int64_t at = 0;
  for (std::string l; std::getline(in, l);) {
    const int64_t start = at;
    at += static_cast<int64_t>(l.size()) + 1;
    if (l.empty()) continue;
    const auto n = static_cast<int64_t>(out.size());
    out.push_back({0, start, n, n});
  }
  return out;
}

}  // namespace ctitan::testing

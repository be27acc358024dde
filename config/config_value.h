// Value codecs of the config keys' types (internal to config/, exposed for tests):
// command-line text -> value, value -> TOML text, and type names for messages and --help.
//
// Types: bool, int64_t, double, std::string, lists of strings / integers / string lists,
// and std::optional<int64_t | double> (None = empty optional, rendered "None").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ctitan::config_detail {

using StrList = std::vector<std::string>;
using IntList = std::vector<int64_t>;
using StrListList = std::vector<std::vector<std::string>>;

template <class T>
struct Tag {};

// ---- TOML rendering (strings quoted and escaped; doubles shortest exact form) ----------
std::string quote(const std::string& s);
std::string format_double(double x);  // "0.0008", "1e-08", "1.0": always a TOML float
std::string render(bool v);
std::string render(int64_t v);
std::string render(double v);
std::string render(const std::string& v);
std::string render(const StrList& v);
std::string render(const IntList& v);
std::string render(const StrListList& v);
template <class T>
std::string render(const std::optional<T>& v) {
  return v ? render(*v) : std::string("None");
}

// ---- command-line text -> value; false when the text is not of that type ---------------
// bool: true/false/1/0 (any case). Lists: comma-separated, blanks trimmed, empty items
// dropped ("" = empty list); StrListList: groups separated by ';' ("a,b;c").
// Optionals: "None"/"none"/"null"/"" = None.
bool parse_text(const std::string& s, bool& out);
bool parse_text(const std::string& s, int64_t& out);
bool parse_text(const std::string& s, double& out);
bool parse_text(const std::string& s, std::string& out);
bool parse_text(const std::string& s, StrList& out);
bool parse_text(const std::string& s, IntList& out);
bool parse_text(const std::string& s, StrListList& out);
bool parse_text(const std::string& s, std::optional<int64_t>& out);
bool parse_text(const std::string& s, std::optional<double>& out);

// ---- type names, in TOML's vocabulary ---------------------------------------------------
inline const char* type_name(Tag<bool>) { return "boolean"; }
inline const char* type_name(Tag<int64_t>) { return "integer"; }
inline const char* type_name(Tag<double>) { return "float"; }
inline const char* type_name(Tag<std::string>) { return "string"; }
inline const char* type_name(Tag<StrList>) { return "array of strings"; }
inline const char* type_name(Tag<IntList>) { return "array of integers"; }
inline const char* type_name(Tag<StrListList>) { return "array of arrays of strings"; }
template <class T>
const char* type_name(Tag<std::optional<T>>) {
  return type_name(Tag<T>());  // TOML cannot spell None: a present value has type T
}

template <class T>
std::string help_type_name(Tag<T> t) {
  return type_name(t);
}
template <class T>
std::string help_type_name(Tag<std::optional<T>>) {
  return std::string(type_name(Tag<T>())) + " or None";
}

// Text used to compare a value with a KeyRules::supported list: strings unquoted,
// everything else as rendered.
inline std::string plain_text(const std::string& v) { return v; }
template <class T>
std::string plain_text(const T& v) {
  return render(v);
}

// Levenshtein distance, for "did you mean".
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace ctitan::config_detail

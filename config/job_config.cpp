// Everything here is derived from the key declarations in job_config.h: each operation
// is a visitor walked over JobConfig::visit_keys (defaults, registry for --help and
// unknown-key detection, TOML reading, command-line overrides, TOML dump, support check).
#include "config/job_config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <toml.hpp>  // toml11 3.7: toml::parse(std::istream&, name), value::location()
#include <type_traits>

#include "config/config_value.h"
#include "config/errors.h"
#include "util/strings.h"

namespace ctitan {

bool is_positive_int_or_op(const std::string& s) {
  if (s == "op") return true;
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return std::stol(s) > 0;
}

namespace {

using config::NoDeduceT;
using namespace config_detail;

const char* const kCommandLine = "command line";

// Keys of older torchtitan TOMLs that ctitan reads and ignores (they change nothing).
const std::map<std::string, std::string> kIgnoredKeys = {
    {"job.use_for_integration_test", "torchtitan's integration-test marker"},
};

[[noreturn]] void fail(const std::string& where, const std::string& body) {
  throw UserError("config error: " + where + ": " + body);
}

std::string message(const std::string& where, const std::string& body) {
  return "config error: " + where + ": " + body;
}

std::string where_in_file(const std::string& file, size_t line) {
  return line ? file + ":" + std::to_string(line) : file;
}

// Problems found while reading one source; the one that comes first (TOML line, or
// argument position) is reported, so a user fixes a file top to bottom.
class Problems {
 public:
  void add(size_t order, std::string msg) { list_.emplace_back(order, std::move(msg)); }
  void throw_first() const {
    if (list_.empty()) return;
    auto first =
        std::min_element(list_.begin(), list_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    throw UserError(first->second);
  }

 private:
  std::vector<std::pair<size_t, std::string>> list_;
};

// ---------------------------------------------------------------------------------------
// Rules: range, choices and text checks of one value. Each returns "" when the value is
// fine, else the tail of the message ("is out of range (must be >= 1)").
// ---------------------------------------------------------------------------------------

std::string number_text(double x) {
  if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

bool has_range(const KeyRules& r) { return r.min || r.max || r.excluded; }

std::string range_text(const KeyRules& r) {
  std::string s;
  for (double a : r.also_allowed) s += number_text(a) + " or ";
  std::string bounds;
  if (r.min) bounds += (r.min_exclusive ? "> " : ">= ") + number_text(*r.min);
  if (r.max)
    bounds += (bounds.empty() ? "" : " and ") + std::string(r.max_exclusive ? "< " : "<= ") + number_text(*r.max);
  s += bounds;
  if (r.excluded) s += " and != " + number_text(*r.excluded) + ": " + r.excluded_why;
  return s;
}

bool number_ok(double x, const KeyRules& r) {
  for (double a : r.also_allowed)
    if (x == a) return true;
  if (std::isnan(x)) return false;
  if (r.min && (x < *r.min || (r.min_exclusive && x == *r.min))) return false;
  if (r.max && (x > *r.max || (r.max_exclusive && x == *r.max))) return false;
  if (r.excluded && x == *r.excluded) return false;
  return true;
}

std::string choices_text(const KeyRules& r) {
  return join(r.choices, ", ") + (r.none_allowed ? " (or \"\" for None)" : "");
}

bool is_choice(const std::string& v, const KeyRules& r) {
  return std::find(r.choices.begin(), r.choices.end(), v) != r.choices.end();
}

std::string violation(bool, const KeyRules&) { return ""; }

std::string violation(double x, const KeyRules& r) {
  if (has_range(r) && !number_ok(x, r)) return "is out of range (must be " + range_text(r) + ")";
  return "";
}

std::string violation(int64_t x, const KeyRules& r) { return violation(static_cast<double>(x), r); }

std::string violation(const std::string& v, const KeyRules& r) {
  if (!r.choices.empty() && !(r.none_allowed && v.empty()) && !is_choice(v, r))
    return "is not one of: " + choices_text(r);
  if (r.text_check && !r.text_check(v)) return std::string("is not valid (expected ") + r.text_expected + ")";
  return "";
}

std::string violation(const StrList& v, const KeyRules& r) {
  if (r.choices.empty()) return "";
  for (const std::string& e : v)
    if (!is_choice(e, r)) return "contains " + quote(e) + ", which is not one of: " + choices_text(r);
  return "";
}

[[maybe_unused]] std::string violation(const IntList& v, const KeyRules& r) {
  for (int64_t e : v)
    if (has_range(r) && !number_ok(static_cast<double>(e), r))
      return "contains " + std::to_string(e) + ", which is out of range (must be " + range_text(r) + ")";
  return "";
}

std::string violation(const StrListList&, const KeyRules&) { return ""; }

template <class T>
std::string violation(const std::optional<T>& v, const KeyRules& r) {
  return v ? violation(*v, r) : "";
}

// ---------------------------------------------------------------------------------------
// Walking the declarations with the current [table.path].
// ---------------------------------------------------------------------------------------

template <class Derived>
class PathVisitor {
 public:
  template <class S>
  void table(S& sub, const char* name, const char* help) {
    stack_.push_back(name);
    self().enter_table(table_path(), help);
    sub.visit_keys(self());
    self().leave_table();
    stack_.pop_back();
  }
  void enter_table(const std::string&, const char*) {}
  void leave_table() {}

 protected:
  std::string table_path() const { return join(stack_, "."); }
  std::string path_of(const std::string& key) const { return stack_.empty() ? key : table_path() + "." + key; }

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
  std::vector<std::string> stack_;
};

// ---------------------------------------------------------------------------------------
// Enumerated keys (KeyEnum, job_config.h) are read, checked, shown and written as their
// spelling: Wire<T> is the type a key's value has in the config's text.
// ---------------------------------------------------------------------------------------

template <class T>
using Wire = std::conditional_t<std::is_enum<T>::value, std::string, T>;

template <class T>
Wire<T> wire(const T& v) {
  if constexpr (std::is_enum<T>::value)
    return key_name(v);
  else
    return v;
}

// A value read and checked against the key's rules (an enum's choices are its spellings).
template <class T>
void set_from_wire(T& field, Wire<T>&& value) {
  if constexpr (std::is_enum<T>::value) {
    if (!key_value(value, field)) throw std::logic_error("[config] enumerated key without its choices: " + value);
  } else {
    field = std::move(value);
  }
}

// ---------------------------------------------------------------------------------------
// Registry: the flat list of keys with their metadata (built once from a default config).
// ---------------------------------------------------------------------------------------

// A KeyRules::supported entry as shown to users: strings quoted, other types as written.
template <class T>
std::string supported_item(Tag<T>, const std::string& s) {
  return s;
}
std::string supported_item(Tag<std::string>, const std::string& s) { return quote(s); }

struct KeyInfo {
  std::string path;   // canonical: "training.seq_len"
  std::string table;  // "training"
  std::string type;   // for --help: "integer", "float or None", ...
  bool is_bool = false;
  std::string default_text;  // TOML rendering
  std::string help;
  KeyRules rules;
  std::vector<std::string> legacy_paths;  // absolute older spellings
  std::vector<std::string> supported_shown;
};

struct Registry {
  std::vector<KeyInfo> keys;                                // declaration order
  std::vector<std::pair<std::string, std::string>> tables;  // (path, help), declaration order
  std::set<std::string> table_paths;                        // canonical tables
  std::set<std::string> legacy_table_paths;                 // tables that exist only in legacy names
  std::map<std::string, size_t> index;                      // canonical and legacy path -> keys[i]
  std::map<std::string, std::string> legacy;                // legacy path -> canonical path

  const KeyInfo* find(const std::string& path) const {
    auto it = index.find(path);
    return it == index.end() ? nullptr : &keys[it->second];
  }
};

class Collector : public PathVisitor<Collector> {
 public:
  template <class T>
  void operator()(T&, const char* key, const NoDeduceT<T>& def, const char* help, const KeyRules& rules = KeyRules()) {
    KeyInfo k;
    k.path = path_of(key);
    k.table = table_path();
    k.type = help_type_name(Tag<Wire<T>>());
    k.is_bool = std::is_same<T, bool>::value;
    k.default_text = render(wire(def));
    k.help = help;
    k.rules = rules;
    for (const std::string& old : rules.legacy)
      k.legacy_paths.push_back(old.find('.') == std::string::npos ? path_of(old) : old);
    for (const std::string& s : rules.supported) k.supported_shown.push_back(supported_item(Tag<Wire<T>>(), s));
    reg.keys.push_back(std::move(k));
  }
  void enter_table(const std::string& path, const char* help) {
    reg.tables.emplace_back(path, help);
    reg.table_paths.insert(path);
  }
  Registry reg;
};

Registry build_registry() {
  JobConfig defaults;
  Collector c;
  defaults.visit_keys(c);
  Registry reg = std::move(c.reg);
  for (size_t i = 0; i < reg.keys.size(); ++i) {
    const KeyInfo& k = reg.keys[i];
    if (k.help.find('\n') != std::string::npos || !reg.index.emplace(k.path, i).second)
      throw std::logic_error("[config] bad declaration of key " + k.path);
  }
  for (size_t i = 0; i < reg.keys.size(); ++i) {
    for (const std::string& old : reg.keys[i].legacy_paths) {
      if (!reg.index.emplace(old, i).second || reg.table_paths.count(old))
        throw std::logic_error("[config] legacy name " + old + " collides with another key");
      reg.legacy[old] = reg.keys[i].path;
      for (size_t dot = old.find('.'); dot != std::string::npos; dot = old.find('.', dot + 1))
        if (!reg.table_paths.count(old.substr(0, dot))) reg.legacy_table_paths.insert(old.substr(0, dot));
    }
  }
  return reg;
}

const Registry& registry() {
  static const Registry reg = build_registry();
  return reg;
}

// "(did you mean X?)" for an unknown name: the nearest candidate by edit distance, else
// one with the same last component (e.g. training.warmup_steps -> lr_scheduler.warmup_steps).
std::string suggestion(const std::string& unknown, const std::vector<std::string>& candidates,
                       const std::string& before = "", const std::string& after = "") {
  std::string best;
  size_t best_d = std::string::npos;
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(unknown, c);
    if (d < best_d) best_d = d, best = c;
  }
  if (!best.empty() && best_d <= std::max<size_t>(2, unknown.size() / 4))
    return " (did you mean " + before + best + after + "?)";
  const std::string leaf = unknown.substr(unknown.rfind('.') + 1);
  for (const std::string& c : candidates)
    if (c.size() > leaf.size() && c.compare(c.size() - leaf.size(), leaf.size(), leaf) == 0 &&
        c[c.size() - leaf.size() - 1] == '.')
      return " (did you mean " + before + c + after + "?)";
  return "";
}

std::vector<std::string> key_paths(const Registry& reg) {
  std::vector<std::string> out;
  for (const KeyInfo& k : reg.keys) out.push_back(k.path);
  return out;
}

std::vector<std::string> table_path_list(const Registry& reg) {
  std::vector<std::string> out;
  for (const auto& t : reg.tables) out.push_back(t.first);
  return out;
}

// ---------------------------------------------------------------------------------------
// TOML values
// ---------------------------------------------------------------------------------------

bool from_toml(const toml::value& v, bool& out) {
  if (!v.is_boolean()) return false;
  out = v.as_boolean();
  return true;
}
bool from_toml(const toml::value& v, int64_t& out) {
  if (!v.is_integer()) return false;
  out = v.as_integer();
  return true;
}
bool from_toml(const toml::value& v, double& out) {  // an integer is a fine float
  if (v.is_floating())
    out = v.as_floating();
  else if (v.is_integer())
    out = static_cast<double>(v.as_integer());
  else
    return false;
  return true;
}
bool from_toml(const toml::value& v, std::string& out) {
  if (!v.is_string()) return false;
  out = v.as_string().str;
  return true;
}
template <class E>
bool from_toml(const toml::value& v, std::vector<E>& out) {
  if (!v.is_array()) return false;
  std::vector<E> items;
  for (const toml::value& e : v.as_array()) {
    E item{};
    if (!from_toml(e, item)) return false;
    items.push_back(std::move(item));
  }
  out = std::move(items);
  return true;
}
template <class T>
bool from_toml(const toml::value& v, std::optional<T>& out) {
  T item{};
  if (!from_toml(v, item)) return false;
  out = std::move(item);
  return true;
}

const char* toml_type(const toml::value& v) {
  switch (v.type()) {
    case toml::value_t::boolean: return "boolean";
    case toml::value_t::integer: return "integer";
    case toml::value_t::floating: return "float";
    case toml::value_t::string: return "string";
    case toml::value_t::array: return "array";
    case toml::value_t::table: return "table";
    case toml::value_t::empty: return "empty";
    default: return "date-time";
  }
}

// "string", "array of integers", "array of mixed types", "empty array".
std::string describe(const toml::value& v) {
  if (!v.is_array()) return toml_type(v);
  const auto& items = v.as_array();
  if (items.empty()) return "empty array";
  for (const toml::value& e : items)
    if (e.type() != items.front().type()) return "array of mixed types";
  return std::string("array of ") + toml_type(items.front()) + "s";
}

// The value as the user wrote it (one line), for messages.
std::string render_toml(const toml::value& v) {
  switch (v.type()) {
    case toml::value_t::boolean: return render(v.as_boolean());
    case toml::value_t::integer: return render(static_cast<int64_t>(v.as_integer()));
    case toml::value_t::floating: return format_double(v.as_floating());
    case toml::value_t::string: return quote(v.as_string().str);
    case toml::value_t::array: {
      std::vector<std::string> items;
      for (const toml::value& e : v.as_array()) items.push_back(render_toml(e));
      return "[" + join(items, ", ") + "]";
    }
    case toml::value_t::table: {
      std::vector<std::string> items;
      for (const auto& kv : v.as_table()) items.push_back(kv.first + " = " + render_toml(kv.second));
      std::sort(items.begin(), items.end());
      return "{" + join(items, ", ") + "}";
    }
    default: {
      std::string s = toml::format(v);
      s.erase(std::remove(s.begin(), s.end(), '\n'), s.end());
      return s;
    }
  }
}

// First line of a toml11 error, without its "[error] toml::parse_xxx: " prefix.
std::string toml_error_summary(const std::string& what) {
  std::string s = what.substr(0, what.find('\n'));
  if (s.rfind("[error] ", 0) == 0) s = s.substr(8);
  if (s.rfind("toml::", 0) == 0) {
    const size_t colon = s.find(": ");
    if (colon != std::string::npos) s = s.substr(colon + 2);
  }
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s.empty() ? "unreadable document" : s;
}

struct TomlLeaf {
  const toml::value* value;
  std::string spelled;  // as written (maybe a legacy name)
  size_t line;
};

// Maps the document's leaves to canonical key paths; reports unknown keys and sections,
// non-tables where a table belongs, and a key given under two spellings.
void collect_leaves(const Registry& reg, const toml::value& table, const std::string& prefix, const std::string& file,
                    std::map<std::string, TomlLeaf>& leaves, Problems& problems) {
  for (const auto& kv : table.as_table()) {
    const std::string path = prefix.empty() ? kv.first : prefix + "." + kv.first;
    const toml::value& v = kv.second;
    const size_t line = v.location().line();
    const std::string where = where_in_file(file, line);
    if (const KeyInfo* key = reg.find(path)) {
      TomlLeaf leaf{&v, path, line};
      auto [it, inserted] = leaves.emplace(key->path, leaf);
      if (!inserted) {
        const TomlLeaf& early = it->second.line <= line ? it->second : leaf;
        const TomlLeaf& late = it->second.line <= line ? leaf : it->second;
        problems.add(late.line,
                     message(where_in_file(file, late.line),
                             late.spelled + " and " + early.spelled + " (line " + std::to_string(early.line) +
                                 ") are the same key " + key->path + " (one is its legacy spelling); keep one"));
      }
    } else if (reg.table_paths.count(path) || reg.legacy_table_paths.count(path)) {
      if (v.is_table())
        collect_leaves(reg, v, path, file, leaves, problems);
      else
        problems.add(line, message(where, path + " = " + render_toml(v) + " has type " + describe(v) +
                                              ", expected table [" + path + "]"));
    } else if (kIgnoredKeys.count(path)) {
      continue;
    } else if (v.is_table()) {
      problems.add(line,
                   message(where, "unknown section [" + path + "]" + suggestion(path, table_path_list(reg), "[", "]")));
    } else {
      problems.add(line, message(where, "unknown key " + path + suggestion(path, key_paths(reg))));
    }
  }
}

class TomlApplier : public PathVisitor<TomlApplier> {
 public:
  TomlApplier(const std::map<std::string, TomlLeaf>& leaves, const std::string& file, Problems& problems)
      : leaves_(leaves), file_(file), problems_(problems) {}

  template <class T>
  void operator()(T& field, const char* key, const NoDeduceT<T>&, const char*, const KeyRules& rules = KeyRules()) {
    auto it = leaves_.find(path_of(key));
    if (it == leaves_.end()) return;
    const TomlLeaf& leaf = it->second;
    const std::string where = where_in_file(file_, leaf.line);
    Wire<T> value{};
    if (!from_toml(*leaf.value, value)) {
      problems_.add(leaf.line, message(where, leaf.spelled + " = " + render_toml(*leaf.value) + " has type " +
                                                  describe(*leaf.value) + ", expected " + type_name(Tag<Wire<T>>())));
      return;
    }
    const std::string bad = violation(value, rules);
    if (!bad.empty()) {
      problems_.add(leaf.line, message(where, leaf.spelled + " = " + render(value) + " " + bad));
      return;
    }
    set_from_wire(field, std::move(value));
  }

 private:
  const std::map<std::string, TomlLeaf>& leaves_;
  const std::string& file_;
  Problems& problems_;
};

// ---------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------

struct CliValue {
  std::string spelled;  // key as written, without "--"
  std::string text;
  bool has_value;  // false only for a bare bool flag (= true)
  size_t position;
};

bool starts_with_dashes(const std::string& s) { return s.size() >= 2 && s[0] == '-' && s[1] == '-'; }

std::map<std::string, CliValue> tokenize(const std::vector<std::string>& args) {
  const Registry& reg = registry();
  std::map<std::string, CliValue> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!starts_with_dashes(arg) || arg.size() == 2) {
      if (arg.size() > 1 && arg[0] == '-' && arg != "--") fail(kCommandLine, "unknown option " + arg);
      fail(kCommandLine,
           "unexpected argument " + quote(arg) + " (options are --section.key VALUE or --section.key=VALUE)");
    }
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    const bool has_eq = eq != std::string::npos;
    if (has_eq) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    const KeyInfo* key = reg.find(name);
    bool negated = false;
    if (!key) {  // --section.no_key sets a bool key to false (torchtitan's spelling)
      const size_t dot = name.rfind('.');
      if (dot != std::string::npos && name.compare(dot + 1, 3, "no_") == 0) {
        const KeyInfo* k = reg.find(name.substr(0, dot + 1) + name.substr(dot + 4));
        if (k && k->is_bool) key = k, negated = true;
      }
    }
    if (!key) fail(kCommandLine, "unknown option --" + name + suggestion(name, key_paths(reg), "--"));
    CliValue v{name, "", true, i};
    if (negated) {
      if (has_eq) fail(kCommandLine, "--" + name + " takes no value");
      v.text = "false";
    } else if (has_eq) {
      v.text = value;
    } else if (i + 1 < args.size() && !starts_with_dashes(args[i + 1])) {
      v.text = args[++i];
    } else if (key->is_bool) {
      v.has_value = false;
    } else {
      fail(kCommandLine, "--" + name + " needs a value (" + key->type + ")");
    }
    out[key->path] = v;
  }
  return out;
}

template <class T>
std::string cli_expected(Tag<T> t) {
  return std::string("is not a valid ") + type_name(t);
}
std::string cli_expected(Tag<bool>) { return "is not a valid boolean (true or false)"; }

class CliApplier : public PathVisitor<CliApplier> {
 public:
  CliApplier(const std::map<std::string, CliValue>& values, Problems& problems)
      : values_(values), problems_(problems) {}

  template <class T>
  void operator()(T& field, const char* key, const NoDeduceT<T>&, const char*, const KeyRules& rules = KeyRules()) {
    auto it = values_.find(path_of(key));
    if (it == values_.end()) return;
    const CliValue& c = it->second;
    Wire<T> value{};
    // A bare flag only reaches here for bool keys (tokenize() checked).
    if (!parse_text(c.has_value ? c.text : std::string("true"), value)) {
      problems_.add(c.position,
                    message(kCommandLine, c.spelled + " = " + quote(c.text) + " " + cli_expected(Tag<Wire<T>>())));
      return;
    }
    const std::string bad = violation(value, rules);
    if (!bad.empty()) {
      problems_.add(c.position, message(kCommandLine, c.spelled + " = " + render(value) + " " + bad));
      return;
    }
    set_from_wire(field, std::move(value));
  }

 private:
  const std::map<std::string, CliValue>& values_;
  Problems& problems_;
};

std::string read_config_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail("--job.config_file", "cannot open " + path + ": " + std::strerror(errno));
  std::string content;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) content.append(buf, n);
  const bool failed = std::ferror(f);
  const int err = errno;
  std::fclose(f);
  if (failed) fail("--job.config_file", "cannot read " + path + ": " + std::strerror(err));
  return content;
}

// ---------------------------------------------------------------------------------------
// Output: TOML dump and the support check
// ---------------------------------------------------------------------------------------

template <class T>
std::string toml_line(const char* key, const T& v) {
  return std::string(key) + " = " + render(v) + "\n";
}
template <class T>
std::string toml_line(const char* key, const std::optional<T>& v) {
  if (!v) return std::string("# ") + key + " = None (unset)\n";  // TOML cannot spell None
  return std::string(key) + " = " + render(*v) + "\n";
}

// Leaf keys of a table are written under its header before its sub-tables (TOML needs
// that order); tables without leaf keys (e.g. [quantize.linear]) get no header. `skip`
// names one key path left out of the text.
class TomlWriter : public PathVisitor<TomlWriter> {
 public:
  explicit TomlWriter(std::string skip = "") : skip_(std::move(skip)) {}
  template <class T>
  void operator()(T& field, const char* key, const NoDeduceT<T>&, const char*, const KeyRules& = KeyRules()) {
    if (path_of(key) != skip_) frames_.back().leaves += toml_line(key, wire(field));
  }
  void enter_table(const std::string& path, const char*) { frames_.push_back({path, "", ""}); }
  void leave_table() {
    Frame f = std::move(frames_.back());
    frames_.pop_back();
    std::string text;
    if (!f.leaves.empty()) text = "\n[" + f.path + "]\n" + f.leaves;
    frames_.back().subtables += text + f.subtables;
  }
  std::string result() const { return frames_.front().leaves + frames_.front().subtables; }

 private:
  struct Frame {
    std::string path, leaves, subtables;
  };
  std::string skip_;
  std::vector<Frame> frames_{Frame{}};
};

// Every key as TOML, less the one named by `skip` (a key path, "" = none).
std::string config_text(const JobConfig& cfg, const std::string& skip) {
  JobConfig copy = cfg;  // visit_keys hands out mutable references
  TomlWriter writer(skip);
  copy.visit_keys(writer);
  return writer.result();
}

class SupportChecker : public PathVisitor<SupportChecker> {
 public:
  template <class T>
  void operator()(T& field, const char* key, const NoDeduceT<T>&, const char*, const KeyRules& rules = KeyRules()) {
    const auto& ok = rules.supported;
    if (ok.empty() || std::find(ok.begin(), ok.end(), plain_text(wire(field))) != ok.end()) return;
    std::vector<std::string> items;
    for (const std::string& s : ok) items.push_back(supported_item(Tag<Wire<T>>(), s));
    throw UserError("not supported yet: " + path_of(key) + " = " + render(wire(field)) +
                    " (ctitan supports: " + join(items, ", ") + ")");
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------

JobConfig parse_job_config_toml(std::istream& in, const std::string& filename) {
  toml::value root;
  try {
    root = toml::parse(in, filename);
  } catch (const toml::exception& e) {
    fail(where_in_file(filename, e.location().line()), "malformed TOML: " + toml_error_summary(e.what()));
  } catch (const std::exception& e) {
    fail(filename, "malformed TOML: " + toml_error_summary(e.what()));
  }
  JobConfig cfg;
  Problems problems;
  std::map<std::string, TomlLeaf> leaves;
  collect_leaves(registry(), root, "", filename, leaves, problems);
  TomlApplier applier(leaves, filename, problems);
  cfg.visit_keys(applier);
  problems.throw_first();
  return cfg;
}

ConfigLoadResult load_job_config(const std::vector<std::string>& args) {
  ConfigLoadResult result;
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      result.help_requested = true;
      return result;
    }
  }
  const std::map<std::string, CliValue> cli = tokenize(args);
  auto file = cli.find("job.config_file");
  if (file != cli.end() && !file->second.text.empty()) {
    std::istringstream in(read_config_file(file->second.text));
    result.config = parse_job_config_toml(in, file->second.text);
  }
  Problems problems;
  CliApplier applier(cli, problems);
  result.config.visit_keys(applier);
  problems.throw_first();
  return result;
}

// job.print_config is an action, not a setting: written out, the file it tells the user to run
// again would print itself and exit instead of training.
std::string job_config_to_toml(const JobConfig& cfg) {
  return "# ctitan effective config (torchtitan v0.2.x tables and keys).\n"
         "# Run it again with: train --job.config_file <this file>\n" +
         config_text(cfg, "job.print_config");
}

bool operator==(const JobConfig& a, const JobConfig& b) { return config_text(a, "") == config_text(b, ""); }

void check_supported(const JobConfig& cfg) {
  JobConfig copy = cfg;
  SupportChecker checker;
  copy.visit_keys(checker);
}

std::vector<std::string> job_config_keys() { return key_paths(registry()); }

std::string job_config_help() {
  const Registry& reg = registry();
  std::map<std::string, std::string> table_help(reg.tables.begin(), reg.tables.end());
  std::ostringstream out;
  out << "Usage: train [--job.config_file FILE.toml] [--section.key VALUE ...] [--help]\n"
         "\n"
         "ctitan reads torchtitan v0.2.x experiment configs. Every key of a [section] below can\n"
         "be set in the TOML file and overridden on the command line as --section.key VALUE or\n"
         "--section.key=VALUE. Precedence: command line > TOML file > defaults.\n"
         "On the command line, lists are comma-separated (a,b,c), a bool flag alone means true\n"
         "(--checkpoint.enable) and --section.no_key means false. A string \"\" stands for\n"
         "torchtitan's None; keys typed \"... or None\" are None when absent (command line: "
         "None).\n"
         "Values outside \"ctitan supports\" are valid torchtitan settings of features ctitan\n"
         "does not have yet: they are refused before training starts.\n";
  std::string current;
  for (const KeyInfo& k : reg.keys) {
    if (k.table != current) {
      current = k.table;
      out << "\n[" << current << "]  " << table_help[current] << "\n";
    }
    std::vector<std::string> notes;
    const KeyRules& r = k.rules;
    if (!r.choices.empty()) notes.push_back("one of: " + choices_text(r));
    if (has_range(r)) notes.push_back("must be " + range_text(r));
    if (r.text_check) notes.push_back(std::string("expects ") + r.text_expected);
    if (!r.supported.empty()) notes.push_back("ctitan supports: " + join(k.supported_shown, ", "));
    if (!k.legacy_paths.empty()) notes.push_back("legacy name: " + join(k.legacy_paths, ", "));
    out << "  --" << k.path << "  " << k.type << " = " << k.default_text;
    if (!notes.empty()) out << "  [" << join(notes, "; ") << "]";
    out << "\n      " << k.help << "\n";
  }
  out << "\nLegacy spellings of older torchtitan TOMLs, read as the key they became:\n";
  for (const auto& [old, canonical] : reg.legacy) out << "  " << old << " -> " << canonical << "\n";
  out << "\nAccepted in TOML files and ignored:\n";
  for (const auto& [path, why] : kIgnoredKeys) out << "  " << path << "  (" << why << ")\n";
  return out.str();
}

}  // namespace ctitan

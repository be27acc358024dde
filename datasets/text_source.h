// Text sources: where the corpus is, and reading it one document at a time.
//
// A source is a corpus file, or a folder of them (non-recursive; files taken in byte order
// of their names; other extensions and dot-files ignored), or a folder followed by a name
// pattern with one '*' (".../en/c4-train.*"). Documents have a global order: file by file,
// and in file order within each file.
//   .jsonl  one JSON object per line with a string field "text" (C4's format); other
//   .json   fields are ignored; blank lines are skipped; any other line is a UserError
//           naming file:line. The text is used exactly as decoded. A .json file holds JSON
//           lines, as torchtitan's c4_test (tests/assets/c4_test/data.json).
//   .jsonl.gz, .json.gz  the same, gzip-compressed (C4's en/*.json.gz), inflated with zlib.
//           Offsets are those of the uncompressed text; seeking to one re-inflates the file
//           from its start and skips (zlib's gzseek), so resume is exact at that cost.
//   .txt    one document per blank-line-separated paragraph: a maximal run of lines that
//           are not empty/whitespace-only, joined with "\n". Chosen over "one document per
//           file" because a book is a single file: Moby-Dick as one document would give
//           every data-parallel rank the whole book (or nothing) instead of disjoint parts.
// Line endings are normalised on read (CRLF counts as LF), and a UTF-8 byte-order mark
// at the start of a file is dropped.
//
//   .ctok   pre-tokenized shards (datasets/token_shard.h): each document is its token ids,
//           memory-mapped; positions and ranges count documents, not bytes.
// Documents are read lazily; only the file list is built up front. A SourcePosition
// (file, byte offset, document index) lets a reader resume exactly where another stopped.
//
// Ranges (set_range), so that data-parallel ranks never parse each other's documents: a
// reader given [begin, end) of a text file takes exactly the documents whose first byte lies
// in it. It seeks to `begin`; when that is not a line start it skips to the next one, and in
// a .txt file it also skips the rest of a paragraph that started before `begin` (a line is a
// continuation when the line before it is not blank); it reads past `end` only to finish its
// last document. Two readers given adjacent ranges thus take every document once. A .gz file
// cannot be entered in the middle (only by inflating everything before): ranges inside it are
// not offered (whole files only, see datasets/sharding.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ctitan {

// Named corpora: moby_dick and sotu (fetched by scripts/fetch_data.sh), and torchtitan's
// c4_test, c4 and c4_validation when their files are under the data root.
const std::vector<std::string>& known_datasets();

// $CTITAN_DATA_DIR when set and non-empty, else <repo_root>/data.
std::string default_data_root(const std::string& repo_root);

// training.dataset_path when non-empty (must exist), else the named corpus under data_root:
//   moby_dick     -> <data_root>/moby_dick/moby_dick.txt
//   sotu          -> <data_root>/sotu/
//   c4_test       -> <data_root>/c4_test/            (torchtitan's tests/assets/c4_test)
//   c4            -> <data_root>/c4/en/c4-train.*    (allenai/c4's layout: en/*.json.gz)
//   c4_validation -> <data_root>/c4/en/c4-validation.*
// UserError for an unknown name or missing files, listing the known names and the fix;
// `section` is the config table the keys are named under ("training" or "validation").
std::string resolve_dataset_path(const std::string& dataset, const std::string& dataset_path,
                                 const std::string& data_root, const std::string& section = "training");

// The corpus files of a source (a file, a folder, or folder/pattern), sorted. UserError when the path
// does not exist, has another extension, or is a folder holding no such file.
std::vector<std::string> list_source_files(const std::string& source_path);

struct Document {
  std::string text;
  int64_t index = 0;         // global position in the corpus order (0-based)
  size_t file = 0;           // index into DocumentReader::files()
  int64_t line = 0;          // 1-based line of the file where the document starts; 0 when not known
                             // (a range read from the middle of a file counts lines only for errors)
  uint64_t offset = 0;       // byte offset of its first line (text) or its index (.ctok): its identity
  std::vector<int32_t> ids;  // .ctok: the document's tokens as stored (with BOS/EOS); text empty
  // Why the document is malformed ("" when it is fine): bad JSON, not a JSON object, no
  // string "text", a NUL byte, invalid UTF-8. Set only with report_bad_documents(true);
  // otherwise a malformed document is a UserError naming file:line. For a malformed
  // document, `line` is the line of its (first) problem.
  std::string error;
};

// Where the next document starts.
struct SourcePosition {
  int64_t next_document = 0;  // global index of the next document
  size_t file = 0;            // index into files(); == files().size() at the end
  uint64_t offset = 0;        // byte offset inside that file
  int64_t line = 0;           // lines of that file consumed so far
};

class DocumentReader {
 public:
  explicit DocumentReader(const std::string& source_path);
  ~DocumentReader();
  DocumentReader(const DocumentReader&) = delete;
  DocumentReader& operator=(const DocumentReader&) = delete;

  const std::string& source_path() const { return source_path_; }
  const std::vector<std::string>& files() const { return files_; }

  // Reads the next document; false at the end of the last file (call rewind() to loop).
  bool next(Document* doc);

  SourcePosition position() const { return pos_; }
  // Continues from a position taken from a reader of the same source. UserError when it
  // cannot belong to these files (file index or offset out of range, offset not at a
  // line start).
  void seek(const SourcePosition& pos);
  void rewind() { seek(SourcePosition{}); }
  // Reads only the documents of file `file` whose first byte (.ctok: index) lies in
  // [begin, end); kToEnd = to the file's end. chain: then go on into the following files,
  // to their ends. Unlike seek(), begin may be any byte: see the opening comment.
  static constexpr uint64_t kToEnd = ~uint64_t{0};
  void set_range(size_t file, uint64_t begin, uint64_t end, bool chain);
  // Bytes taken from corpus files (uncompressed, with the line ends) since construction.
  uint64_t bytes_read() const { return bytes_read_; }
  // true: malformed documents are returned with Document::error set (text undefined) and
  // reading goes on after them; false (the default): they are a UserError.
  void report_bad_documents(bool on) { report_bad_ = on; }

 private:
  bool open_current();  // opens files_[pos_.file] at pos_.offset; false past the last file
  // One line of the current file, '\n'/'\r' stripped; checked: NUL bytes and UTF-8 looked at.
  bool read_line(std::string* line, bool checked = true);
  void align();                         // at a range's begin: to the first document starting at or after it
  int64_t absolute_line(int64_t line);  // a line counted from where reading began -> 1-based
  void close();
  bool next_in_file(Document* doc);  // false when the current file has no more documents
  [[noreturn]] void fail_line(const std::string& what);
  void bad_line(const std::string& what);  // fail_line, or remembered when reporting

  std::string source_path_;
  std::vector<std::string> files_;
  SourcePosition pos_;
  void* gz_ = nullptr;  // gzFile of files_[pos_.file] (zlib reads plain files directly)
  bool open_ = false;
  bool report_bad_ = false;
  std::string pending_error_;  // first problem of the document being read
  int64_t pending_line_ = 0;   // and its line
  uint64_t end_ = kToEnd;      // documents starting at or after this are another reader's
  bool chain_ = true;          // go on into the next file at the end of this one
  bool done_ = false;          // a range without chain has ended
  bool align_ = false;         // the range's begin may be inside a line or a paragraph
  int64_t line_base_ = 0;      // lines before where pos_.line started counting; -1: not known
  uint64_t line_origin_ = 0;   // the byte offset where it started
  uint64_t bytes_read_ = 0;
  struct Shard;  // an open .ctok file (token_shard.h)
  std::unique_ptr<Shard> shard_;
};

}  // namespace ctitan

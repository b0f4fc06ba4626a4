// A JSON request body read for a model server: every array of numbers that is rectangular (each
// sibling the same length, every leaf at the same depth) is scanned straight into one flat buffer of
// int64 (all integers, each in range), float64 (any other number) or bool (all true/false), with
// its shape; the server turns that buffer into a numpy array without a Python object per element.
// Anything else (objects, strings, ragged or mixed arrays) is left to the caller to build as Python
// values, from the events this scanner reports. No Python here: the binding owns the objects.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardrec::serving {

struct JsonError : std::runtime_error {
  JsonError(const std::string& what, size_t at)
      : std::runtime_error(what + " at byte " + std::to_string(at)), offset(at) {}
  size_t offset;
};

// A rectangular array of numbers: its shape and its values, in one of the three kinds.
struct NumberArray {
  enum Kind { kInt, kFloat, kBool } kind = kInt;
  std::vector<int64_t> shape;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<uint8_t> bools;
  size_t size() const { return kind == kInt ? ints.size() : kind == kFloat ? floats.size() : bools.size(); }
};

class JsonScanner {
 public:
  JsonScanner(const char* data, size_t size) : p_(data), begin_(data), end_(data + size) {}

  size_t offset() const { return static_cast<size_t>(p_ - begin_); }
  const char* at() const { return p_; }
  void seek(const char* to) { p_ = to; }
  bool done() {
    skip_space();
    return p_ == end_;
  }

  char peek() {
    skip_space();
    if (p_ == end_) throw JsonError("unexpected end of the body", offset());
    return *p_;
  }
  void expect(char c) {
    if (peek() != c) throw JsonError(std::string("expected '") + c + "'", offset());
    ++p_;
  }
  bool take(char c) {
    if (peek() != c) return false;
    ++p_;
    return true;
  }

  // Tries the array that starts here as a rectangular array of numbers. On success the scanner is
  // past it; on failure (returns false) it is where it was, for the caller's general parse.
  bool number_array(NumberArray& out) {
    const char* start = p_;
    out = NumberArray();
    std::vector<int64_t> counts;
    int leaf_depth = -1;
    bool any_float = false, any_bool = false, any_number = false;
    if (!scan_level(out, counts, 0, leaf_depth, any_float, any_bool, any_number) || (any_bool && any_number)) {
      p_ = start;
      return false;
    }
    out.shape.assign(counts.begin(), counts.end());
    if (any_bool) {
      out.kind = NumberArray::kBool;
    } else if (any_float) {
      out.kind = NumberArray::kFloat;
      // Integers seen before the first float were kept as int64: the values are re-read as doubles
      // in order, so that the buffer holds every number as Python's json would give it.
      out.floats.clear();
      out.ints.clear();
      p_ = start;
      rescan_floats(out.floats);
    }
    return true;
  }

  // A JSON string's bytes, escapes decoded to UTF-8 (a lone surrogate kept as its 3 bytes, as
  // Python's json keeps it). The scanner is past the closing quote.
  std::string string() {
    expect('"');
    std::string out;
    const char* run = p_;
    while (true) {
      if (p_ == end_) throw JsonError("unterminated string", offset());
      char c = *p_;
      if (c == '"') {
        out.append(run, p_);
        ++p_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) throw JsonError("control character in a string", offset());
      if (c != '\\') {
        ++p_;
        continue;
      }
      out.append(run, p_);
      if (++p_ == end_) throw JsonError("unterminated string", offset());
      char e = *p_++;
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t code = hex4();
          if (code >= 0xD800 && code < 0xDC00 && end_ - p_ >= 6 && p_[0] == '\\' && p_[1] == 'u') {
            const char* back = p_;
            p_ += 2;
            uint32_t low = hex4();
            if (low >= 0xDC00 && low < 0xE000) {
              code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
            } else {
              p_ = back;
            }
          }
          utf8(code, out);
          break;
        }
        default: throw JsonError("invalid escape in a string", offset() - 1);
      }
      run = p_;
    }
  }

  // A number token: its text, and whether it is an integer literal (no fraction, no exponent).
  std::string number_text(bool& integer) {
    skip_space();
    const char* s = p_;
    integer = true;
    if (match("NaN") || match("Infinity") || match("-Infinity")) {
      integer = false;
      return std::string(s, p_);
    }
    if (p_ < end_ && *p_ == '-') ++p_;
    if (p_ == end_ || !digit(*p_)) throw JsonError("invalid value", static_cast<size_t>(s - begin_));
    if (*p_ == '0') {
      ++p_;
    } else {
      while (p_ < end_ && digit(*p_)) ++p_;
    }
    if (p_ < end_ && *p_ == '.') {
      integer = false;
      ++p_;
      if (p_ == end_ || !digit(*p_)) throw JsonError("invalid number", offset());
      while (p_ < end_ && digit(*p_)) ++p_;
    }
    if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
      integer = false;
      ++p_;
      if (p_ < end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      if (p_ == end_ || !digit(*p_)) throw JsonError("invalid number", offset());
      while (p_ < end_ && digit(*p_)) ++p_;
    }
    return std::string(s, p_);
  }

  static double to_double_of(const std::string& text) { return to_double(text); }

  bool match(const char* word) {
    size_t n = std::strlen(word);
    if (static_cast<size_t>(end_ - p_) >= n && std::memcmp(p_, word, n) == 0) {
      p_ += n;
      return true;
    }
    return false;
  }

 private:
  static bool digit(char c) { return c >= '0' && c <= '9'; }

  void skip_space() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }

  uint32_t hex4() {
    if (end_ - p_ < 4) throw JsonError("invalid \\u escape", offset());
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = *p_++;
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else throw JsonError("invalid \\u escape", offset() - 1);
    }
    return v;
  }

  static void utf8(uint32_t c, std::string& out) {
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if (c < 0x800) {
      out += static_cast<char>(0xC0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out += static_cast<char>(0xE0 | (c >> 12));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (c >> 18));
      out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    }
  }

  // One number as a leaf of a number array: int64 when an integer literal in range, else double.
  // Returns false for anything that is not a number (the array is then not a number array).
  bool leaf(NumberArray& out, bool& any_float, bool& any_bool, bool& any_number) {
    skip_space();
    if (p_ == end_) return false;
    char c = *p_;
    if (c == 't' || c == 'f') {
      if (match("true")) out.bools.push_back(1);
      else if (match("false")) out.bools.push_back(0);
      else return false;
      any_bool = true;
      return true;
    }
    if (!(digit(c) || c == '-' || c == 'N' || c == 'I')) return false;
    const char* s = p_;
    bool integer;
    try {
      number_text(integer);
    } catch (const JsonError&) {
      p_ = s;
      return false;
    }
    any_number = true;
    if (integer && !any_float) {
      int64_t v;
      auto r = std::from_chars(s, p_, v);
      if (r.ec != std::errc() || r.ptr != p_) return false;  // out of int64: Python's ints, not ours
      out.ints.push_back(v);
    } else {
      any_float = true;
    }
    return true;
  }

  bool scan_level(NumberArray& out, std::vector<int64_t>& counts, int depth, int& leaf_depth, bool& any_float,
                  bool& any_bool, bool& any_number) {
    if (depth >= 32) return false;  // deeper than numpy (and a tensor) goes: the general parse keeps it
    if (!take('[')) return false;
    int64_t n = 0;
    if (!take(']')) {
      while (true) {
        if (peek() == '[') {
          if (!scan_level(out, counts, depth + 1, leaf_depth, any_float, any_bool, any_number)) return false;
        } else {
          if (leaf_depth == -1) leaf_depth = depth;
          if (leaf_depth != depth || !leaf(out, any_float, any_bool, any_number)) return false;
        }
        ++n;
        if (take(']')) break;
        if (!take(',')) return false;
      }
    }
    if (n == 0) return false;  // an empty array: the caller keeps Python's []
    // Inner arrays close first: counts[d] is the length every array at depth d must have.
    if (static_cast<int>(counts.size()) <= depth) counts.resize(depth + 1, -1);
    if (counts[depth] == -1) {
      counts[depth] = n;
    } else if (counts[depth] != n) {
      return false;  // ragged
    }
    return true;
  }

  void rescan_floats(std::vector<double>& out) {
    int depth = 0;
    while (true) {
      char c = peek();
      if (c == '[') {
        ++depth;
        ++p_;
      } else if (c == ']') {
        ++p_;
        if (--depth == 0) return;
      } else if (c == ',') {
        ++p_;
      } else {
        bool integer;
        std::string text = number_text(integer);
        out.push_back(to_double(text));
      }
    }
  }

  static double to_double(const std::string& text) {
    if (text == "NaN") return std::nan("");
    if (text == "Infinity") return HUGE_VAL;
    if (text == "-Infinity") return -HUGE_VAL;
    double v = 0;
    auto r = std::from_chars(text.data(), text.data() + text.size(), v);
    if (r.ec == std::errc::result_out_of_range) return std::strtod(text.c_str(), nullptr);  // +-inf or 0, as Python
    return v;
  }

  const char* p_;
  const char* begin_;
  const char* end_;
};

}  // namespace shardrec::serving

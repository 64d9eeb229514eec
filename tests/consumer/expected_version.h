#pragma once

// The consumers' common start: `consumer <expected attn version>`, checked
// against the version attn's headers carry.

#include <attn/version.h>

#include <iostream>
#include <string>

// 0 when argv holds one version and the headers carry it; otherwise the
// exit code to return (2: usage, 1: another version), having said why.
inline int check_expected_version(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: consumer <expected attn version>\n";
    return 2;
  }
  if (std::string(ATTN_VERSION) != argv[1]) {
    std::cerr << "headers say attn " << ATTN_VERSION << ", expected " << argv[1] << "\n";
    return 1;
  }
  return 0;
}

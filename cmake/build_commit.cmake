# Writes OUT (a header defining MOERAIL_BUILD_COMMIT, the commit the sources are at) when it differs from what is
# there, so a rebuild after a commit names the new commit and nothing else recompiles. Run at every build by the
# moerail_build_commit target (tools/CMakeLists.txt): cmake -DSOURCE_DIR=... -DOUT=... -P build_commit.cmake
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY "${SOURCE_DIR}"
  OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT commit)
  if(EXISTS "${OUT}")
    return()  # git failed here (another user, no git): keep what an earlier build wrote
  endif()
  set(commit "unknown")
endif()
set(content "#pragma once\n#define MOERAIL_BUILD_COMMIT \"${commit}\"\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL content)
  file(WRITE "${OUT}" "${content}")
endif()

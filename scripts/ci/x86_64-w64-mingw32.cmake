# CMake toolchain: Debian's mingw-w64 cross compilers (gcc-mingw-w64-x86-64-posix, g++-mingw-w64-x86-64-posix);
# programs built with it are linked statically and run under wine64 (scripts/ci/windows.sh).
set(CMAKE_SYSTEM_NAME      Windows)
set(CMAKE_SYSTEM_PROCESSOR x86_64)
set(CMAKE_C_COMPILER       x86_64-w64-mingw32-gcc-posix)
set(CMAKE_CXX_COMPILER     x86_64-w64-mingw32-g++-posix)
set(CMAKE_RC_COMPILER      x86_64-w64-mingw32-windres)
set(CMAKE_FIND_ROOT_PATH   /usr/x86_64-w64-mingw32)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# no libstdc++/libwinpthread DLLs to find at run time
set(CMAKE_EXE_LINKER_FLAGS_INIT "-static")
set(CMAKE_CROSSCOMPILING_EMULATOR /usr/lib/wine/wine64)
